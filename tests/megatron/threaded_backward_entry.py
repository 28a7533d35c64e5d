"""Run an entry script with every autograd backward on a new thread, as CUDA's autograd runs it.

``python threaded_backward_entry.py SCRIPT ARGS...`` (under torchrun): see
``megatron_vshape.testing.autograd_threads.backward_on_new_threads``. Prints how many backwards ran that way.
"""

import runpy
import sys

from megatron_vshape.testing.autograd_threads import backward_on_new_threads

if __name__ == "__main__":
    script, sys.argv = sys.argv[1], sys.argv[1:]
    with backward_on_new_threads() as engine:
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            print(f"[threaded-backward] {engine.threads_used} backwards ran on new threads", flush=True)
