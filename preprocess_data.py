#!/usr/bin/env python
"""Preprocess instruction data into Megatron indexed datasets for the RL stages (trl_ppo, grpo).

Thin CLI entry; the work is done by :mod:`mindspeed_llm.data.preprocess`. Run with ``--help``.
"""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mindspeed_llm.data.preprocess import main

    sys.exit(main())
