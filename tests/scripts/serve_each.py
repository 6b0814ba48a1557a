"""docs/examples/serve_reft.py's loading and answering, in this one fresh process, for each folder of interventions.

    python serve_each.py OUT.pt MODEL PROMPT POSITIONS FOLDER...    (OUT.pt: {folder: answer})
"""

import sys
from argparse import Namespace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "docs" / "examples"))
import serve_reft  # noqa: E402
from train_reft import answer  # noqa: E402

out, model, prompt, positions, *folders = sys.argv[1:]
options = Namespace(positions=positions, share_weights=False, max_new_tokens=16)
answers = {}
for folder in folders:
    tokenizer, reft_model = serve_reft.load(model, folder)
    answers[folder] = answer(reft_model, tokenizer, options, prompt)
torch.save(answers, out)
