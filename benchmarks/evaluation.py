"""lm-eval with a ReFT (``--model reft``) against lm-eval's own ``hf`` model on the same base and tasks, side by
side in one run (goal: at most 1.10 x).

    OMP_NUM_THREADS=1 python benchmarks/evaluation.py --out benchmarks/results/evaluation-cpu.jsonl     # CPU, tiny
    python benchmarks/evaluation.py --device cuda --hidden 2048 --layers 16 --documents 512 \\
        --batch-size 32 --rounds 3 --out benchmarks/results/evaluation-1xH100.jsonl                 # one GPU

A Llama of ``--hidden`` x ``--layers`` (random weights, the BPE tokenizer of ``pyvene-dist tiny-model``) is saved
to a folder with a LoReFT (rank 4, ``f1+l1`` on 4 layers, as train_reft.py saves one); two local tasks of
``--documents`` documents each: multiple choice (4 choices, loglikelihood) and generate_until (``--new-tokens``).
Each model is built once (``HFLM(pretrained=FOLDER)``, ``ReftLM(reft=FOLDER)``). Two scopes, each in ``--rounds``
rounds where the two models take turns (the first of one round is the last of the next; one untimed call opens
each block), wall time and the process's CPU time of each call:

- ``requests_<kind>``: the model's request method alone (``loglikelihood``, ``generate_until``) on the task's
  requests, built once: what the two models do differently;
- ``lm_eval_<kind>``: ``lm_eval.simple_evaluate`` of the task, the whole evaluation but the model's loading
  (lm-eval's own work, the same for both, is in it: its environment report alone runs ``pip list``).

Rows (``benchmarks/common.py``): per measure and provider, p20/p50/p80 ms, each round's median, the CPU time's, and
against ``hf`` the ratio of medians and the spread of the round-by-round ratios (``ratio_*``, ``cpu_ratio_*``). On
a CPU shared with other work, the CPU time is the steadier measure (a call's wall time counts the time it waited
for a core).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

import torch  # noqa: E402

TASKS = {"multiple_choice": "bench_mc", "generate_until": "bench_gen"}
YAML = {
    "bench_mc": 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
                "doc_to_target: label\nmetric_list:\n  - metric: acc\n",
    "bench_gen": 'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
                 'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: {new_tokens}\n  do_sample: false\n'
                 "metric_list:\n  - metric: exact_match\n",
}


def build(folder: Path, options) -> None:
    """The base and its tokenizer, a LoReFT saved beside them with train_settings.json, and the two tasks."""
    import pyreft
    import transformers

    from pyvene_dist.testing.models import WORDS, save_checkpoint

    save_checkpoint(folder / "base", hidden=options.hidden, layers=options.layers, heads=max(4, options.hidden // 64),
                    kv_heads=max(2, options.hidden // 256), seed=0)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder / "base")
    layers = sorted({round(i * (options.layers - 1) / 3) for i in range(4)})
    torch.manual_seed(0)
    reft_model = pyreft.get_reft_model(base, pyreft.ReftConfig(representations=[
        {"layer": layer, "component": "block_output", "low_rank_dimension": 4,
         "intervention": pyreft.LoreftIntervention(embed_dim=options.hidden, low_rank_dimension=4, dtype=torch.float32)}
        for layer in layers * 2]), set_device=False)
    reft_model.save(str(folder / "reft"), save_to_hf_hub=False)
    (folder / "reft" / "train_settings.json").write_text(json.dumps(
        {"model": str(folder / "base"), "positions": "f1+l1", "share_weights": False, "dtype": "float32"}))
    generator = torch.Generator().manual_seed(1)
    documents = []
    for _ in range(options.documents):
        count = int(torch.randint(4, options.prompt_words + 1, (1,), generator=generator))
        words = [WORDS[i] for i in torch.randint(len(WORDS), (count,), generator=generator)]
        documents.append({"question": " ".join(words), "choices": ["red", "blue cat", "tree house", "dog"],
                          "label": 0, "answer": "red"})
    tasks = folder / "tasks"
    tasks.mkdir()
    (tasks / "documents.json").write_text(json.dumps(documents))
    for name, body in YAML.items():
        (tasks / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                            f"    test: {tasks / 'documents.json'}\ntest_split: test\n"
                                            + body.replace("{new_tokens}", str(options.new_tokens)))


#: Each task kind's request method, which ``requests_<kind>`` times alone.
METHODS = {"multiple_choice": "loglikelihood", "generate_until": "generate_until"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=24, help="each prompt has 4 to this many words")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/evaluation-cpu.jsonl")
    options = parser.parse_args(argv)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from pyvene_dist.evaluation.harness import ReftLM

    device = torch.device(options.device)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        build(folder, options)
        manager = TaskManager(include_path=str(folder / "tasks"), include_defaults=False)
        models = {"hf": HFLM(pretrained=str(folder / "base"), device=options.device, batch_size=options.batch_size,
                             dtype="float32"),
                  "reft": ReftLM(reft=str(folder / "reft"), device=options.device, batch_size=options.batch_size)}
        for kind, name in TASKS.items():
            task = manager.load([name])["tasks"][name]
            task.build_all_requests(rank=0, world_size=1)
            requests = list(task.instances)
            scopes = {
                f"requests_{kind}": {provider: functools.partial(getattr(lm, METHODS[kind]), requests, disable_tqdm=True)
                                     for provider, lm in models.items()},
                f"lm_eval_{kind}": {provider: functools.partial(lm_eval.simple_evaluate, model=lm, tasks=[name],
                                                                task_manager=manager, verbosity="WARNING")
                                    for provider, lm in models.items()},
            }
            for measure, steps in scopes.items():
                host, cpu = {}, {}
                times = common.interleaved(steps, rounds=options.rounds, steps=options.rounds, device=device,
                                           host=host, cpu=cpu)
                rows += [{"measure": measure, "provider": provider, "hidden": options.hidden, "layers": options.layers,
                          "documents": options.documents, "requests": len(requests), "batch_size": options.batch_size,
                          "new_tokens": options.new_tokens, "rounds": options.rounds,
                          **common.summary(times[provider], host[provider], cpu[provider])} for provider in steps]
    common.compare(rows, "hf", ["hf", "reft"])
    meta = common.metadata(device, torch.float32)
    rows = [{**row, **meta} for row in rows]
    common.append_rows(options.out, rows)
    for row in rows:
        print(common.show(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
