"""Stand-in for ``modules.shared_state``: the job state the webui's jobs report and the Interrupt button sets."""
import time


class State:
    skipped = False
    interrupted = False
    stopping_generation = False
    job = ""
    job_no = 0
    job_count = 0
    job_timestamp = "0"
    sampling_step = 0
    sampling_steps = 0
    textinfo = None
    time_start = None

    def interrupt(self):
        self.interrupted = True

    def begin(self, job: str = "(unknown)"):
        """A job starts: counters reset, ``job_count`` -1 until the job says how many it has."""
        self.sampling_step = 0
        self.sampling_steps = 0
        self.time_start = time.time()
        self.job_count = -1
        self.job_no = 0
        self.skipped = False
        self.interrupted = False
        self.stopping_generation = False
        self.textinfo = None
        self.job = job

    def end(self):
        self.job = ""
        self.job_count = 0
