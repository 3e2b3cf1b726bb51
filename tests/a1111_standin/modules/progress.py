"""Stand-in for ``modules.progress``: the task ids the progress bar polls (queued, current, finished)."""
from collections import OrderedDict

current_task = None
pending_tasks = OrderedDict()
finished_tasks = []
recorded_results = []


def add_task_to_queue(id_job):
    pending_tasks[id_job] = len(pending_tasks)


def start_task(id_task):
    global current_task
    current_task = id_task
    pending_tasks.pop(id_task, None)


def finish_task(id_task):
    global current_task
    if current_task == id_task:
        current_task = None
    finished_tasks.append(id_task)


def record_results(id_task, res):
    recorded_results.append((id_task, res))
