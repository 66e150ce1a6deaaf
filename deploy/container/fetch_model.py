#!/usr/bin/env python3
"""Fetch a Hugging Face model repository into a directory (the Kubernetes init containers).

  kvmesh-fetch-model [--tokenizer-only] REPO DIR

REPO empty: nothing to fetch (the processes then use the image's built-in tiny model).
--tokenizer-only: the tokenizer, chat template and configs, not the weights (the frontend).
$KVMESH_MODEL_REVISION pins a revision; $HF_TOKEN authenticates (gated models). Uses
huggingface_hub, which the image has through `tokenizers`. A directory already holding the
files is left as it is (huggingface_hub skips files it has).
"""

from __future__ import annotations

import argparse
import os
import sys

TOKENIZER_FILES = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]
"""What --tokenizer-only fetches: tokenizer(.json/_config.json), chat template, configs."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh-fetch-model", description=__doc__.split("\n")[0])
    parser.add_argument("repo", help="Hugging Face repository id (empty: nothing to fetch)")
    parser.add_argument("dir", help="target directory")
    parser.add_argument("--tokenizer-only", action="store_true", help="skip the weights")
    args = parser.parse_args(argv)
    if not args.repo:
        print("kvmesh-fetch-model: no repository given; the built-in tiny model will be used")
        return 0
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        print("kvmesh-fetch-model: huggingface_hub is not installed", file=sys.stderr)
        return 2
    path = snapshot_download(
        repo_id=args.repo,
        revision=os.environ.get("KVMESH_MODEL_REVISION") or None,
        local_dir=args.dir,
        allow_patterns=TOKENIZER_FILES if args.tokenizer_only else None,
    )
    print(f"kvmesh-fetch-model: {args.repo} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
