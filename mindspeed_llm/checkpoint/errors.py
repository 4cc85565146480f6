"""The errors a conversion or a training run stops with when a checkpoint or the weights are unusable (no megatron
import, so that the command-line entry points can name them before anything heavy is loaded)."""


from mindspeed_llm.errors import UserError


class ConversionError(ValueError):
    """A checkpoint cannot be converted as asked; the message names the file, tensor or flag."""


class CheckpointError(UserError, ValueError):
    """An unusable --load / --save directory or a failed save; the message names the path and the fix."""


class NonFiniteError(RuntimeError):
    """NaN or inf where training must not go on (a loss, a gradient, weights about to be saved)."""


class DivergenceError(NonFiniteError):
    """Training diverged without a NaN: the weights jumped by orders of magnitude, or the policy went uniform."""
