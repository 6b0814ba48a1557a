"""lm-eval-harness's ``--model reft`` (pyvene_dist.evaluation.harness) on a tiny Llama with a ReFT trained here.

The ReFT is trained once for the module with pyreft (every answer " red"), on a checkpoint folder saved as users
bring one, and lm-eval runs once on it in one process; the tasks are local (a YAML file each and one JSON file).
Every number lm-eval reports with the ReFT is checked against a loop written here over pyreft's own data helper,
locations and forward, one request at a time; without the ReFT against lm-eval's own ``--model hf``; and on 2
processes (one world: ``pyvene-dist eval`` as ``accelerate launch``/``torchrun`` start it, then over a base sharded
by FSDP2 and by DeepSpeed ZeRO-3, with ``generate_over`` too) against the one process's numbers.
"""

import functools
import json
import logging
import os
import re
import textwrap
from unittest import mock

import pytest
import torch

import helpers
import pyvene_dist
from pyvene_dist.testing.models import WORDS, save_checkpoint

lm_eval = pytest.importorskip("lm_eval")

TASKS = ["words_mc", "words_gen", "words_rolling"]
POSITIONS = "f1+l1"
INTERVENTIONS = 4  # layers 0 and 1, the first and the last positions each their own
CHOICES = ["red", "blue", "cat", "tree"]

#: The three request types: multiple choice (loglikelihood), generate_until, loglikelihood_rolling. The
#: questions have 1 to 5 tokens (a 1-token context has pyreft's spare slots on the continuation's first token);
#: the prompts of the generation task have at least 2 (generation intervenes on the prompt alone).
YAML = {
    "words_mc": """
        output_type: multiple_choice
        doc_to_text: "{{question}}"
        doc_to_choice: "{{choices}}"
        doc_to_target: label
        metric_list:
          - metric: acc
    """,
    "words_gen": """
        output_type: generate_until
        doc_to_text: "{{prompt}}"
        doc_to_target: "{{answer}}"
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 3
          do_sample: false
        filter_list:
          - name: first_word
            filter:
              - function: regex
                regex_pattern: "(\\\\w+)"
              - function: take_first
        metric_list:
          - metric: exact_match
    """,
    "words_rolling": """
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{prompt}} {{answer}}"
        metric_list:
          - metric: word_perplexity
    """,
}


def _documents(count=10):
    generator = torch.Generator().manual_seed(7)

    def words(n):
        return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (n,), generator=generator))

    return [{"question": words(1 + index % 5), "prompt": words(2 + index % 3), "choices": CHOICES,
             "label": int(torch.randint(len(CHOICES), (1,), generator=generator)),
             "answer": ["red", "dog"][index % 2]} for index in range(count)]


def _train_reft(base, out):
    """pyreft's quickstart on the folder: LoReFT at the first and last prompt positions of layers 0 and 1,
    trained to answer " red", saved with ``ReftModel.save`` and train_settings.json (train_reft.py's)."""
    import pyreft
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(0)
    reft_model = pyreft.get_reft_model(model, pyreft.ReftConfig(representations=[
        {"layer": layer, "component": "block_output", "low_rank_dimension": 4,
         "intervention": pyreft.LoreftIntervention(embed_dim=32, low_rank_dimension=4, dtype=torch.float32)}
        for layer in [0, 1] * 2]))
    prompts = [document["prompt"] for document in _documents(16)]
    data = pyreft.make_multiple_position_supervised_data_module(
        tokenizer, model, prompts, [" red"] * len(prompts), positions=POSITIONS, num_interventions=INTERVENTIONS)
    arguments = transformers.TrainingArguments(output_dir=str(out / "run"), max_steps=10, learning_rate=0.2,
                                               per_device_train_batch_size=8, use_cpu=True, report_to=[],
                                               save_strategy="no", disable_tqdm=True)
    pyreft.ReftTrainerForCausalLM(model=reft_model, processing_class=tokenizer, args=arguments, **data).train()
    reft_model.save(str(out / "reft"), save_to_hf_hub=False)
    (out / "reft" / "train_settings.json").write_text(json.dumps(
        {"model": str(base), "positions": POSITIONS, "share_weights": False, "dtype": "float32"}))
    return out / "reft"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The base folder, the ReFT folder, the tasks' folder, and lm-eval's results with the ReFT in one process."""
    import transformers

    out = tmp_path_factory.mktemp("evaluation")
    base = out / "base"
    save_checkpoint(base)
    # The random tiny Llama's logits are nearly uniform (its lm_head's weights are drawn with std 0.02): scaled,
    # a few steps of training move its answers.
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    model.save_pretrained(base)
    tasks = out / "tasks"
    tasks.mkdir()
    (tasks / "words.json").write_text(json.dumps(_documents()))
    for name, body in YAML.items():
        (tasks / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                            f"    test: {tasks / 'words.json'}\ntest_split: test\n"
                                            + textwrap.dedent(body))
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv("HF_HUB_OFFLINE", "1")
        environment.setenv("HF_DATASETS_OFFLINE", "1")
        helpers.patch()
        try:
            reft = _train_reft(base, out)
            folders = {"base": str(base), "reft": str(reft), "tasks": str(tasks)}
            yield {**folders, "single": _evaluate(folders, "reft", f"reft={reft}")}
        finally:
            pyvene_dist.unpatch()


def _evaluate(folders, model, model_args):
    import pyvene_dist.evaluation

    pyvene_dist.evaluation.register()
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, batch_size=4, device="cpu",
                                   log_samples=True, task_manager=_local_tasks(folders["tasks"]))


def _local_tasks(folder):
    """lm-eval's tasks of ``folder`` alone: indexing its own thousands of task files takes 10 to 30 seconds, on
    every rank."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=folder, include_defaults=False)


def _by_document(samples):
    """Each task's responses by document: [log-likelihood, greedy] per choice, the rolling log-likelihood, or the
    generated text (the ``--log_samples`` files hold them as text)."""
    def response(task, found):
        if task == "words_gen":
            return found
        if isinstance(found, (list, tuple)):
            return [float(found[0]), found[1] in (True, "True")]
        return float(found)

    return {task: {sample["doc_id"]: [response(task, found[0]) for found in sample["resps"]] for sample in documents}
            for task, documents in samples.items()}


def _metrics(results):
    return {task: {name: float(value) for name, value in metrics.items() if "," in name and "stderr" not in name}
            for task, metrics in results["results"].items()}


# --- with the ReFT: pyreft's own forward, one request at a time ------------------------------------------------

def _pyreft_log_likelihood(reft_model, ids, labels, locations):
    """pyreft's forward on one example (its intervention locations ``[interventions, slots]``): the summed
    log-probability of its labelled tokens, and whether each is the argmax."""
    _, output = reft_model({"input_ids": ids[None]}, unit_locations={"sources->base": (None, locations[:, None].tolist())})
    log_probs = output.logits[0, :-1].log_softmax(-1)
    scored = labels[1:] != -100
    targets = labels[1:][scored]
    return log_probs[scored].gather(-1, targets[:, None]).sum().item(), bool(
        (log_probs[scored].argmax(-1) == targets).all())


def test_with_the_reft_lm_eval_reports_what_pyreft_computes(trained):
    """Multiple choice: each (question, " choice") through pyreft's own data helper, as training builds an
    example (the question the prompt, the choice the answer; ``nonstop``: lm-eval scores no end of sequence);
    loglikelihood_rolling: the text as the answer to the prefix token alone, at pyreft's locations for that
    prompt; generation: each prompt alone through pyreft's ``generate``. lm-eval batched 4 requests a forward,
    padded, each row at its own positions: the numbers agree to float32 rounding, the metrics exactly."""
    import pyreft
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(trained["base"])
    reft_model = pyreft.ReftModel.load(trained["reft"], transformers.AutoModelForCausalLM.from_pretrained(
        trained["base"]))
    reft_model.eval()
    found = _by_document(trained["single"]["samples"])
    documents = _documents()
    expected_mc, expected_rolling, expected_gen = {}, {}, {}
    pairs = [(document["question"], f" {choice}") for document in documents for choice in CHOICES]
    examples = pyreft.make_multiple_position_supervised_data_module(
        tokenizer, reft_model.model, [question for question, _ in pairs], [choice for _, choice in pairs],
        positions=POSITIONS, num_interventions=INTERVENTIONS, nonstop=True)["train_dataset"]
    with torch.no_grad():
        for index, document in enumerate(documents):
            expected_mc[index] = [_pyreft_log_likelihood(reft_model, torch.tensor(example["input_ids"]),
                                                         torch.tensor(example["labels"]),
                                                         torch.tensor(example["intervention_locations"]))
                                  for example in examples.select(range(index * len(CHOICES),
                                                                       (index + 1) * len(CHOICES)))]

            text = tokenizer(f"{document['prompt']} {document['answer']}")["input_ids"]
            ids = torch.tensor([tokenizer.bos_token_id, *text])
            locations = torch.tensor(pyreft.get_intervention_locations(
                last_position=1, positions=POSITIONS, num_interventions=INTERVENTIONS, pad_mode="last"))
            expected_rolling[index] = _pyreft_log_likelihood(reft_model, ids, torch.tensor([-100, *text]), locations)[0]

            prompt = tokenizer(document["prompt"], return_tensors="pt")
            locations = pyreft.get_intervention_locations(last_position=prompt["input_ids"].shape[1],
                                                          positions=POSITIONS, num_interventions=INTERVENTIONS,
                                                          pad_mode="last")
            _, generated = reft_model.generate(prompt, unit_locations={"sources->base": (None, [[at] for at in locations])},
                                               intervene_on_prompt=True, max_new_tokens=3, do_sample=False,
                                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            expected_gen[index] = tokenizer.decode(generated[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)

    for index in range(len(documents)):
        reported = found["words_mc"][index]
        torch.testing.assert_close(torch.tensor([ll for ll, _ in reported]),
                                   torch.tensor([ll for ll, _ in expected_mc[index]]), rtol=1e-5, atol=1e-5,
                                   msg=f"words_mc document {index}")
        assert [greedy for _, greedy in reported] == [greedy for _, greedy in expected_mc[index]]
        assert found["words_rolling"][index][0] == pytest.approx(expected_rolling[index], rel=1e-5, abs=1e-5)
        assert found["words_gen"][index] == [expected_gen[index]], f"words_gen document {index}"
    chosen = [max(range(len(CHOICES)), key=lambda i: expected_mc[index][i][0]) for index in range(len(documents))]
    metrics = _metrics(trained["single"])
    assert metrics["words_mc"]["acc,none"] == sum(
        choice == document["label"] for choice, document in zip(chosen, documents)) / len(documents)
    first_words = [re.findall(r"\w+", expected_gen[index])[:1] for index in range(len(documents))]
    assert metrics["words_gen"]["exact_match,first_word"] == sum(
        words == [document["answer"]] for words, document in zip(first_words, documents)) / len(documents)
    # The ReFT changes answers: " red" wins every question of the length it was trained on (2 to 4 tokens; a
    # 1-token question is intervened on at the answer's first token, as pyreft trains such a prompt).
    assert [choice for choice, document in zip(chosen, documents) if len(document["question"].split()) > 1] == [0] * 8


def test_without_the_reft_it_reports_what_lm_evals_hf_model_does(trained):
    """``--model reft`` with only ``pretrained``: the base through the same scoring and generation code, which
    must give lm-eval's ``--model hf`` numbers (and differ from the ReFT's)."""
    bare = _evaluate(trained, "reft", f"pretrained={trained['base']}")
    hf = _evaluate(trained, "hf", f"pretrained={trained['base']}")
    assert _by_document(bare["samples"]) == _by_document(hf["samples"])
    assert _metrics(bare) == _metrics(hf)
    assert _metrics(bare)["words_mc"] != _metrics(trained["single"])["words_mc"]


def test_bad_arguments_are_refused_naming_them(trained, tmp_path):
    """``--model_args`` that cannot be what the user meant: each refused, naming the argument and what was found."""
    import shutil

    from pyvene_dist.evaluation import reft_settings
    from pyvene_dist.evaluation.harness import ReftLM

    with pytest.raises(ValueError, match=r"reft: expected a folder ReftModel\.save wrote .*, which does not exist"):
        reft_settings(tmp_path / "missing")
    unsaid = tmp_path / "unsaid"  # no train_settings.json: the positions and the base come from the arguments
    shutil.copytree(trained["reft"], unsaid)
    (unsaid / "train_settings.json").unlink()
    with pytest.raises(ValueError, match=r"positions: reft=.* has no train_settings\.json; pass the positions"):
        reft_settings(unsaid)
    with pytest.raises(ValueError, match=r"pretrained: reft=.* has no train_settings\.json naming the base model"):
        reft_settings(unsaid, positions=POSITIONS)
    assert reft_settings(unsaid, positions=POSITIONS, pretrained=trained["base"]).pretrained == trained["base"]
    with pytest.raises(ValueError, match=r"pretrained: expected the base model's folder, found '.*moved', which is "
                                         r"not there"):
        reft_settings(trained["reft"], pretrained=str(tmp_path / "moved"))
    with pytest.raises(ValueError, match=r"share_weights: expected True or False, found 'yes'"):
        reft_settings(trained["reft"], share_weights="yes")
    with pytest.raises(ValueError, match=r"dtype: expected one of float32, bfloat16, float16 or auto, found 'float8'"):
        reft_settings(trained["reft"], dtype="float8")
    with pytest.raises(ValueError, match=r"positions='f1\+x2': expected pyreft's form"):
        reft_settings(trained["reft"], positions="f1+x2")
    with pytest.raises(ValueError, match=r"pretrained: expected the base model's folder \(or reft="):
        ReftLM()


# --- on 2 processes ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(trained):
    """What the ranks compare with: the folders, and one process's metrics and responses (picklable)."""
    return {**{name: trained[name] for name in ("base", "reft", "tasks")}, "metrics": _metrics(trained["single"]),
            "responses": _by_document(trained["single"]["samples"])}


def _assert_agrees(found, reference, where):
    """Accuracy and exact match equal one process's, the perplexity to 1e-6 of it and the log-likelihoods to
    float32 rounding (other rows shared their batches, padded otherwise), the generated texts equal."""
    assert found["metrics"].keys() == reference["metrics"].keys(), where
    for task, metrics in reference["metrics"].items():
        for name, value in metrics.items():
            close = pytest.approx(value, rel=1e-6) if "perplexity" in name else value
            assert found["metrics"][task][name] == close, (where, task, name)
    for task, documents in reference["responses"].items():
        assert found["responses"][task].keys() == documents.keys(), (where, task)
        for document, expected in documents.items():
            got = found["responses"][task][document]
            if task == "words_gen":
                assert got == expected, (where, task, document)
            else:
                flat = lambda responses: torch.tensor([r[0] if isinstance(r, list) else r for r in responses])  # noqa: E731
                torch.testing.assert_close(flat(got), flat(expected), rtol=1e-5, atol=1e-5,
                                           msg=f"{where}: {task} {document}")


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _cli_on_every_rank(reference, out):
    """``pyvene-dist eval`` in each rank of the world, whose environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) is
    what ``torchrun --nproc_per_node 2`` and ``accelerate launch --config_file docs/configs/accelerate-ddp.yaml``
    give their processes: the lines lm-eval logged here. The command
    indexes the local tasks alone (``_local_tasks``), and prints lm_eval's table in this process: pytablewriter
    formats it in a pool of ``cpu_count()`` processes, which the world's ranks (daemonic) may not start."""
    from lm_eval.tasks import TaskManager

    from pyvene_dist.__main__ import main

    logger, lines = logging.getLogger("lm_eval.api.task"), _Lines()
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        with mock.patch.object(TaskManager, "__init__", functools.partialmethod(TaskManager.__init__,
                                                                                include_defaults=False)), \
                mock.patch("multiprocessing.cpu_count", return_value=1):
                assert main(["eval", "--model", "reft", "--model_args", f"reft={reference['reft']}", "--tasks", *TASKS,
                         "--include_path", reference["tasks"], "--batch_size", "4", "--device", "cpu",
                         "--output_path", str(out), "--log_samples"]) == 0
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    return lines.lines


def _written(out):
    """What ``--output_path`` and ``--log_samples`` wrote: the metrics and the responses by document."""
    results, = out.rglob("results_*.json")
    samples = {task: [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
               for task in TASKS}
    return {"metrics": _metrics(json.loads(results.read_text())), "responses": _by_document(samples)}


def _over_the_sharded_base(reft_model, tokenizer, reference, where):
    """``generate_over`` and lm-eval (``ReftLM.from_model``) on a ReFT whose base is sharded over the ranks: one
    process's answers and numbers, on rank 0 where lm-eval gathers them."""
    import torch.distributed as dist

    from pyvene_dist.evaluation import generate_over
    from pyvene_dist.evaluation.harness import ReftLM

    prompts = [document["prompt"] for document in _documents()]
    expected = [reference["responses"]["words_gen"][index][0] for index in range(len(prompts))]
    assert generate_over(reft_model, tokenizer, prompts, positions=POSITIONS, batch_size=3, max_new_tokens=3) == \
        expected, where
    lm = ReftLM.from_model(reft_model, tokenizer, positions=POSITIONS, batch_size=4)
    assert lm.synced and lm.world_size == 2, where
    results = lm_eval.simple_evaluate(model=lm, tasks=TASKS, log_samples=True,
                                      task_manager=_local_tasks(reference["tasks"]))
    if dist.get_rank() == 0:
        _assert_agrees({"metrics": _metrics(results), "responses": _by_document(results["samples"])}, reference, where)


@pytest.mark.slow
@pytest.mark.world_size(2)
def test_two_ranks_score_their_shares_and_over_a_sharded_base_agree_with_one(reference, tmp_path):
    """In one world of 2 CPU processes, one process's numbers (the module's run), each time:

    - ``pyvene-dist eval`` (lm_eval's command line) on every rank: each builds and scores its half of the
      documents (``HFLM`` alone has every rank score everything on CPUs), and rank 0 writes the gathered results;
    - ``generate_over`` (pyreft's generation loop, every rank its share) on the whole base;
    - the base sharded by FSDP2 (``fully_shard``), then partitioned by DeepSpeed ZeRO-3 (``deepspeed.initialize``
      of the base, every parameter partitioned): ``generate_over`` and lm-eval through ``ReftLM.from_model``,
      every forward a collective on both ranks.
    """
    import pyreft
    import torch.distributed as dist
    import transformers

    from pyvene_dist.evaluation import generate_over
    from pyvene_dist.fully_shard import fully_shard_model
    from pyvene_dist.gather import partitioned

    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    helpers.patch()
    rank = dist.get_rank()
    lines = _cli_on_every_rank(reference, tmp_path / "out")
    assert f"Building contexts for words_mc on rank {rank}..." in lines, lines
    dist.barrier()  # rank 0 has written the files
    if rank == 0:
        _assert_agrees(_written(tmp_path / "out"), reference, "pyvene-dist eval")

    tokenizer = transformers.AutoTokenizer.from_pretrained(reference["base"])
    base = transformers.AutoModelForCausalLM.from_pretrained(reference["base"])
    reft_model = pyreft.ReftModel.load(reference["reft"], base)
    reft_model.eval()
    prompts = [document["prompt"] for document in _documents()]
    assert generate_over(reft_model, tokenizer, prompts, positions=POSITIONS, batch_size=3, max_new_tokens=3) == \
        [reference["responses"]["words_gen"][index][0] for index in range(len(prompts))]
    fully_shard_model(base)
    _over_the_sharded_base(reft_model, tokenizer, reference, "FSDP2")

    deepspeed = pytest.importorskip("deepspeed")
    base = transformers.AutoModelForCausalLM.from_pretrained(reference["base"])
    deepspeed.initialize(model=base, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}})
    assert partitioned(base.parameters())
    reft_model = pyreft.ReftModel.load(reference["reft"], base)
    reft_model.eval()
    _over_the_sharded_base(reft_model, tokenizer, reference, "ZeRO-3")
