"""Run an entry script with every autograd backward on a new thread, as CUDA's autograd runs it.

``python threaded_backward_entry.py SCRIPT ARGS...`` (under torchrun): see
``tests/_wgrad_support.backward_on_new_threads``. Prints how many backwards ran that way.
"""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _autograd_threads import backward_on_new_threads  # noqa: E402

if __name__ == "__main__":
    script, sys.argv = sys.argv[1], sys.argv[1:]
    with backward_on_new_threads() as engine:
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            print(f"[threaded-backward] {engine.threads_used} backwards ran on new threads", flush=True)
