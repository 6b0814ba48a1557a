"""pyvene's own test suite (v0.1.8), run stock and with ``pyvene_dist.patch()``, compared test by test.

    python tests/upstream/pyvene_suite.py [--tests FOLDER] [--llama]

prints each mode's outcome counts, the tests that fail stock (with the known reason), and every test that
passes stock but not patched; it exits 1 when there is one. tests/upstream/test_pyvene_suite.py runs the same in CI.

The tests are pyvene's, unmodified, from ``../shared/upstream/pyvene-v0.1.8`` beside the repository
(``PYVENE_DIST_PYVENE_TESTS`` names another folder holding ``tests/``). Each mode gets a copy in a
temporary folder, with a conftest that seeds ``random``, numpy and torch before every test (pyvene's tests
draw layers and inputs at random: both modes then draw the same ones), and in the patched mode also calls
``helpers.patch()`` (so ``PYVENE_DIST_TEST_WITHOUT`` applies). The two pytest sessions run at once.

Hub models: some integration tests load ``gpt2``, ``roneneldan/TinyStories-33M``, ``google/flan-t5-small``
and tokenizers by name. ``hub_folder`` writes each as a local folder of that name, with the published config
(sizes matter: the tests intervene at layer 10, on 12 heads, on a 768-wide mask, on token 14628), random
weights, and a tokenizer trained with ``tokenizers`` on the tests' sentences (one token per word, as GPT-2's
BPE splits them). Both sessions run in a folder holding those, with ``HF_HUB_OFFLINE=1`` and an empty
``HF_HOME``: ``from_pretrained("gpt2")`` finds ``./gpt2`` before any cache. (A hub cache layout would not
serve: ``pv.create_gpt2(cache_dir=...)`` points the model load at a fresh empty folder of the test's own.)
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS_ENV = "PYVENE_DIST_PYVENE_TESTS"
UPSTREAM = ROOT.parent / "shared" / "upstream" / "pyvene-v0.1.8"
MODES = ("stock", "patched")

#: One test class builds a 4-layer Llama of hidden size 4096 (1.1B parameters, 4.4 GB in float32) and runs
#: it 32 times: over 9 minutes for the two sessions on two loaded cores. It runs alone (``--llama``), on a GPU.
LLAMA = "tests/integration_tests/InterventionWithLlamaTestCase.py"

#: Tests that fail stock too, and why (pyvene v0.1.8 on transformers 5, the local random-weight models).
STOCK_FAILURES = {
    "ComplexInterventionWithGPT2TestCase::test_clean_run_positive":
        "its reference forward (tests/utils.py GPT2_RUN) calls transformers' eager_attention_forward with "
        "attention_mask=None; transformers 5 passes GPT-2's causal mask in that argument, so the reference "
        "attends to later tokens and differs from the model",
    "InterventionWithGPT2TestCase::test_with_multiple_heads_positions_vanilla_intervention_positive":
        "the same non-causal reference forward (GPT2_RUN) as ComplexInterventionWithGPT2TestCase",
    "IntervenableBasicTestCase::test_customized_intervention_function_get":
        "pyvene maps GPT-2's attention_weight to the input of the module attn.attn_dropout, which transformers 5 "
        "never calls (its attention applies nn.functional.dropout); the collecting hook never runs and pyvene "
        "fails with KeyError: 'layer_10_comp_attention_weight_unit_pos_nunit_1#0'",
}

SEEDING_CONFTEST = '''
import random

import numpy
import pytest
import torch


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The same draws in both modes, from setUpClass on."""
    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)
'''

PATCHING_CONFTEST = '''
import sys

sys.path[:0] = [{root!r}, {tests!r}]
from helpers import patch  # noqa: E402

patch()
'''


@dataclass(frozen=True)
class Outcome:
    outcome: str  # passed, failed, error or skipped
    text: str = ""  # the traceback or skip reason pytest reported


def tests_folder() -> Path:
    return Path(os.environ.get(TESTS_ENV, UPSTREAM))


def missing() -> str | None:
    """Why the suite cannot run here, or None."""
    folder = tests_folder()
    if not (folder / "tests" / "unit_tests").is_dir():
        return f"pyvene's tests are not at {folder}/tests (the shared folder beside the repository, or {TESTS_ENV})"
    return None


# --- the hub models, as local folders --------------------------------------------------------------------

#: The sentences the tests tokenize; each word becomes one token.
SENTENCES = ("The capital of Spain is", "The capital of Italy is", "The capital of China is",
             "The Space Needle is in downtown", "When John and Mary went to the shops, Mary gave the bag to",
             "Once upon a time there was")


def _byte_level_bpe():
    """GPT-2's kind of tokenizer (byte-level BPE, no prefix space), trained on SENTENCES."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(SENTENCES, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")


def _llama_bpe():
    """Llama's kind (BPE with byte fallback over metaspace words), trained on SENTENCES."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    bpe.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=1000, special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _t5_unigram():
    """T5's kind (``T5Tokenizer`` is a Unigram model; pad, eos, unk first, as T5 numbers them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.decoder = decoders.Metaspace()
    unigram.train_from_iterator(SENTENCES * 4, trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=unigram, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def hub_folder(folder: Path) -> Path:
    """Write the models and tokenizers the tests load by name into ``folder``, each under its hub name."""
    import torch
    from transformers import (GPT2Config, GPT2LMHeadModel, GPTNeoConfig, GPTNeoForCausalLM, T5Config,
                              T5ForConditionalGeneration)

    gpt2_tokenizer = _byte_level_bpe()
    # The published configs of the hub's gpt2 (GPT2Config's defaults), TinyStories-33M and flan-t5-small.
    models = {
        "gpt2": GPT2LMHeadModel(GPT2Config()),
        "roneneldan/TinyStories-33M": GPTNeoForCausalLM(GPTNeoConfig(
            hidden_size=768, num_layers=4, num_heads=16, attention_types=[[["global", "local"], 2]],
            max_position_embeddings=2048, window_size=256, embed_dropout=0, attention_dropout=0,
            resid_dropout=0, bos_token_id=50256, eos_token_id=50256)),
        "google/flan-t5-small": T5ForConditionalGeneration(T5Config(
            d_model=512, d_kv=64, d_ff=1024, num_layers=8, num_decoder_layers=8, num_heads=6,
            feed_forward_proj="gated-gelu", tie_word_embeddings=False, vocab_size=32128,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
    }
    tokenizers = {"gpt2": gpt2_tokenizer, "EleutherAI/gpt-neo-125M": gpt2_tokenizer,
                  "sharpbai/alpaca-7b-merged": _llama_bpe(), "google/flan-t5-small": _t5_unigram()}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for name, model in models.items():
            model.save_pretrained(folder / name)
    for name, tokenizer in tokenizers.items():
        tokenizer.save_pretrained(folder / name)
    return folder


# --- the two sessions ----------------------------------------------------------------------------------

def _session(mode: str, work: Path, hub: Path, select: list[str], timeout: float) -> Path:
    """Copy the tests into ``work/mode``, run pytest there, and return its JUnit XML."""
    session = work / mode
    shutil.copytree(tests_folder() / "tests", session / "tests")
    (session / "pytest.ini").write_text("[pytest]\npython_files = *TestCase.py\n")
    conftest = SEEDING_CONFTEST
    if mode == "patched":
        conftest += PATCHING_CONFTEST.format(root=str(ROOT), tests=str(ROOT / "tests"))
    (session / "conftest.py").write_text(conftest)
    cwd = session / "cwd"  # the tests write ./tmp and ./test_output_dir_prefix-* here; the hub names resolve here
    cwd.mkdir()
    for entry in hub.iterdir():
        (cwd / entry.name).symlink_to(entry)
    threads = max(1, (os.cpu_count() or 2) // len(MODES))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(work / "hf-home"), "PYTHONSAFEPATH": "1",
           "OMP_NUM_THREADS": str(threads), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    report = session / "outcomes.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:pyvene_dist",
               "-c", str(session / "pytest.ini"), "--rootdir", str(session), f"--junitxml={report}",
               *[str(session / path) for path in select]]
    if LLAMA not in select:
        command += ["--ignore", str(session / LLAMA)]
    log = session / "pytest.log"
    with log.open("w") as out:
        code = subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if code not in (0, 1) or not report.exists():  # 0: all passed, 1: some failed; else pytest itself broke
        raise RuntimeError(f"pyvene's suite, {mode}: pytest exited {code}\n{log.read_text()[-3000:]}")
    return report


def outcomes(report: Path) -> dict[str, Outcome]:
    """``Class::test`` -> its outcome, from pytest's JUnit XML."""
    found = {}
    for case in ElementTree.parse(report).iter("testcase"):
        test = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        reported = {child.tag: child for child in case}
        for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            if tag in reported:
                found[test] = Outcome(outcome, reported[tag].text or reported[tag].get("message", ""))
                break
        else:
            found[test] = Outcome("passed")
    return found


def run(work: Path, *, llama: bool = False, timeout: float = 1200) -> dict[str, dict[str, Outcome]]:
    """Both modes' outcomes. ``llama`` runs the Llama class alone (``LLAMA``); otherwise every other test."""
    hub = hub_folder(work / "hub")
    select = [LLAMA] if llama else ["tests/unit_tests", "tests/integration_tests"]
    with ThreadPoolExecutor(len(MODES)) as pool:
        reports = dict(zip(MODES, pool.map(lambda mode: _session(mode, work, hub, select, timeout), MODES)))
    return {mode: outcomes(report) for mode, report in reports.items()}


def counts(found: dict[str, Outcome]) -> str:
    kinds = ("passed", "failed", "error", "skipped")
    return ", ".join(f"{sum(o.outcome == kind for o in found.values())} {kind}" for kind in kinds)


def last_lines(text: str, count: int = 12) -> str:
    return "\n".join("      " + line for line in text.rstrip().splitlines()[-count:])


def regressions(results: dict[str, dict[str, Outcome]]) -> list[str]:
    """Every test that passes stock and not patched, with the patched failure's last lines."""
    stock, patched = results["stock"], results["patched"]
    lost = []
    for test, outcome in sorted(stock.items()):
        after = patched.get(test, Outcome("not run"))
        if outcome.outcome == "passed" and after.outcome != "passed":
            lost.append(f"{test}: {after.outcome} patched\n{last_lines(after.text)}")
    return lost


def unexplained_stock_failures(results: dict[str, dict[str, Outcome]]) -> list[str]:
    """Stock failures STOCK_FAILURES does not list (a hub model that did not load, a new release)."""
    return [f"{test}: {outcome.outcome} stock\n{last_lines(outcome.text)}"
            for test, outcome in sorted(results["stock"].items())
            if outcome.outcome in ("failed", "error") and test not in STOCK_FAILURES]


def summary(results: dict[str, dict[str, Outcome]]) -> str:
    lines = [f"{mode}: {counts(found)}" for mode, found in results.items()]
    failing = [test for test, outcome in sorted(results["stock"].items()) if outcome.outcome in ("failed", "error")]
    lines += ["fails stock:"] + [f"  {test}: {STOCK_FAILURES.get(test, 'not listed')}" for test in failing]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, help=f"a folder holding pyvene's tests/ (default {UPSTREAM})")
    parser.add_argument("--llama", action="store_true", help=f"run {LLAMA} alone (a GPU's work)")
    parser.add_argument("--keep", type=Path, help="run in this new folder and keep it (each mode's pytest.log)")
    arguments = parser.parse_args()
    if arguments.tests:
        os.environ[TESTS_ENV] = str(arguments.tests)
    if missing():
        sys.exit(missing())
    if arguments.keep:
        arguments.keep.mkdir(parents=True)
        results = run(arguments.keep, llama=arguments.llama)
    else:
        with tempfile.TemporaryDirectory(prefix="pyvene-suite-") as work:
            results = run(Path(work), llama=arguments.llama)
    print(summary(results))
    lost = regressions(results)
    print("passes stock, not patched:" if lost else "every test that passes stock passes patched")
    print("\n".join(lost))
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
