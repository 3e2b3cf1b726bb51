"""Stand-in for ``modules.call_queue``: the GPU call wrapper of the webui's buttons (queue lock, job state,
task id for the progress bar, errors shown in the last output, the time taken appended to it)."""
import html
import threading
import time

from modules import progress, shared

queue_lock = threading.Lock()       # upstream: a FIFO lock with the same context-manager use


def wrap_gradio_gpu_call(func, extra_outputs=None):
    def f(*args, **kwargs):
        is_task = bool(args) and isinstance(args[0], str) and args[0].startswith("task(") and args[0].endswith(")")
        id_task = args[0] if is_task else None
        if is_task:
            progress.add_task_to_queue(id_task)
        with queue_lock:
            shared.state.begin(job=id_task)
            progress.start_task(id_task)
            try:
                res = func(*args, **kwargs)
                progress.record_results(id_task, res)
            finally:
                progress.finish_task(id_task)
            shared.state.end()
        return res
    return wrap_gradio_call(f, extra_outputs=extra_outputs, add_stats=True)


def wrap_gradio_call(func, extra_outputs=None, add_stats=False):
    def f(*args, **kwargs):
        started = time.perf_counter()
        try:
            res = list(func(*args, **kwargs))
        except Exception as e:  # upstream: reported, and shown as the last output
            print(f"Error completing request: {type(e).__name__}: {e}")
            res = list(extra_outputs or [None, ""]) + [f"<div class='error'>{html.escape(f'{type(e).__name__}: {e}')}</div>"]
        finally:
            shared.state.skipped = False
            shared.state.interrupted = False
            shared.state.stopping_generation = False
            shared.state.job_count = 0
            shared.state.job = ""
        if add_stats:
            res[-1] += f"<div class='performance'><p class='time'>Time taken: {time.perf_counter() - started:.1f} sec.</p></div>"
        return tuple(res)
    return f
