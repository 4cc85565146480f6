"""RL post-training entry point: `torchrun ... posttrain_gpt.py --stage trl_ppo|grpo <Megatron flags>`."""

import os
import sys


def main(argv=None) -> int:
    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.checkpoint.errors import NonFiniteError
    from mindspeed_llm.errors import UserError
    from mindspeed_llm.run_config import config_argv

    try:
        # --config FILE.yaml becomes the file's flags, in front of the command line's (which win)
        args = parse_args(config_argv(argv), world_size=int(os.environ.get("WORLD_SIZE", "1")))
        from mindspeed_llm.rl.trainer import run

        run(args)
    except UserError as exc:
        # A user's mistake: the message names the flag and the fix; a traceback would only hide it.
        print(f"posttrain_gpt.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except NonFiniteError as exc:  # training diverged: stopped before anything non-finite was saved
        print(f"posttrain_gpt.py: error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
