"""docs/examples/serve_reft.py's loading and answering, in this one fresh process, for each folder of interventions,
with what train_reft.py saved beside them (its train_settings.json: model, positions, shared weights, dtype).

    python serve_each.py OUT.pt PROMPT FOLDER...    (OUT.pt: {folder: answer})
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "docs" / "examples"))
import serve_reft  # noqa: E402

out, prompt, *folders = sys.argv[1:]
answers = {}
for folder in folders:
    found = serve_reft.settings(folder)
    tokenizer, reft_model = serve_reft.load(found["model"], folder, found["dtype"])
    answers[folder] = serve_reft.answer(reft_model, tokenizer, prompt, found["positions"], found["share_weights"])
torch.save(answers, out)
