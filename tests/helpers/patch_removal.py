"""megatron's originals in place of the project's patches, for a block: the patch-removal tests show what a patch
fixes by running without it. The patches are put back after the block (the warm ranks of `multiproc` run other
bodies after this one)."""

import contextlib


@contextlib.contextmanager
def without_patch(target_suffix: str):
    """Every applied patch whose target ends with `target_suffix` undone for the block, the others applied."""
    from mindspeed_llm import patches

    entries = [entry for entry in patches._APPLIED if entry[3].endswith(target_suffix)]
    if not entries:
        raise LookupError(f"no applied patch targets *{target_suffix}; applied: {patches.applied()}")
    # the owner's own entry (a class's `__new__` is a staticmethod there, unwrapped by getattr)
    patched = [(owner, attr, vars(owner)[attr]) for owner, attr, _, _ in entries]
    for owner, attr, original, _ in entries:
        setattr(owner, attr, original)
    try:
        yield
    finally:
        for owner, attr, value in patched:
            setattr(owner, attr, value)
