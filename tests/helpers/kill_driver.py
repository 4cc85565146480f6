"""A stand-in for `posttrain_gpt.py` that is SIGKILLed as soon as its save of iteration $KILL_AT is complete (the
checkpoint published): the resume tests run it, then the real program with the same command line."""

KILL_AFTER_SAVE = """
import os, signal, sys
import mindspeed_llm.checkpoint.training as training_ckpt
original = training_ckpt.save
def save(root, iteration, *args, **kwargs):
    original(root, iteration, *args, **kwargs)
    if iteration == int(os.environ["KILL_AT"]):
        os.kill(os.getpid(), signal.SIGKILL)
training_ckpt.save = save
import posttrain_gpt
sys.exit(posttrain_gpt.main(sys.argv[1:]))
"""


def write_kill_after_save(path):
    """Writes the driver to `path` (run it as `python path ARGS...` with KILL_AT in the environment); returns path."""
    path.write_text(KILL_AFTER_SAVE)
    return path
