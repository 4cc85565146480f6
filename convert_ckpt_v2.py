#!/usr/bin/env python
"""MindSpeed-LLM's newer conversion scripts call convert_ckpt_v2.py: the same converter as convert_ckpt.py."""
import sys

from convert_ckpt import main

if __name__ == "__main__":
    sys.exit(main())
