"""Call recorder for ``benchmarks/request_path.py``: on the path only while that script runs.

Python imports ``sitecustomize`` at start-up in every process whose ``PYTHONPATH`` holds this
folder: the router, the nodes and their engine-core processes. With ``PDSERVE_TRACE_DIR`` set,
each process records the calls into the repository's own code (time, file, function) while
``PDSERVE_TRACE_DIR/on`` exists, and appends them to ``<pid>.jsonl`` there.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

_DIR = os.environ.get("PDSERVE_TRACE_DIR")
_ROOT = os.environ.get("PDSERVE_TRACE_ROOT", "")


def _install(out_dir: str, root: str) -> None:
    events: list[tuple[float, str, str]] = []
    state = {"on": False}
    skip = os.path.join(root, "benchmarks") + os.sep

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call" and state["on"]:
            name = frame.f_code.co_filename
            if name.startswith(root) and not name.startswith(skip):
                events.append((time.time(), name[len(root) + 1 :], frame.f_code.co_name))

    def flush() -> None:
        path = os.path.join(out_dir, f"{os.getpid()}.jsonl")
        header = {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv}
        with open(path, "a") as out:
            out.write(json.dumps(header) + "\n")
            while True:
                time.sleep(0.05)
                on = os.path.exists(os.path.join(out_dir, "on"))
                if on != state["on"]:  # tells the script this process now records (or not)
                    state["on"] = on
                    out.write(json.dumps({"on": on, "time": time.time()}) + "\n")
                batch = events[:]
                del events[: len(batch)]  # calls appended meanwhile stay for the next flush
                for item in batch:
                    out.write(json.dumps(item) + "\n")
                out.flush()

    sys.setprofile(profile)
    threading.setprofile(profile)
    threading.Thread(target=flush, name="trace-flush", daemon=True).start()


if _DIR:
    _install(_DIR, _ROOT.rstrip(os.sep))
