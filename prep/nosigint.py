"""Imported first by `prep cache`'s forkserver (`prep.processes.PRELOAD`): Ctrl-C is ignored from its start.

A terminal's Ctrl-C reaches the whole process group. The forkserver ignores it only once its imports are done,
so one pressed while it still imports torch and MONAI printed their traceback. The worker processes it forks
keep this setting: Ctrl-C is `prep cache`'s to handle (it stops the tasks after their current item)."""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
