"""Stand-in for ``modules.errors``: ``report`` prints and records the message."""
import sys
import traceback

standin_reported = []


def report(message, *, exc_info=False):
    standin_reported.append(message)
    print(message, file=sys.stderr)
    if exc_info:
        traceback.print_exc()
