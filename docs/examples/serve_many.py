"""An OpenAI-compatible server of a base model and several ReFTs: ``pyvene-dist serve`` (docs/serving.md), which
runs transformers' own serving code (``transformers serve``'s handlers, continuous batching) with each request's
``model`` naming its ReFT. Kept for the command lines that name this file; the flags are ``pyvene-dist serve``'s.

    python docs/examples/serve_many.py --reft poet=out/poet/reft --reft coder=out/coder/reft --port 8000
"""

import sys

from pyvene_dist.serving.command import main

if __name__ == "__main__":
    sys.exit(main())
