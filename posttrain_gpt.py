"""RL post-training entry point: `torchrun ... posttrain_gpt.py --stage trl_ppo|grpo <Megatron flags>`."""

import os
import sys


def main(argv=None) -> int:
    from mindspeed_llm.arguments import ArgumentError, parse_args

    try:
        args = parse_args(argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ArgumentError as exc:
        print(f"posttrain_gpt.py: error: {exc}", file=sys.stderr)
        return 2
    from mindspeed_llm.rl.trainer import run

    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
