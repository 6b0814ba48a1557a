"""``reft_tokenizer_keyword``: pyreft's trainers take ``tokenizer=`` (its README, its examples) as transformers 5's
``processing_class``; HF Trainer itself is left as it is. The README's whole flow is
tests/upstream/test_pyreft_flows.py's."""

import inspect

import pytest

from pyvene_dist.testing.models import import_pyreft, reft_model, tiny_llama


def test_tokenizer_is_taken_as_the_processing_class(patched, tmp_path):
    pyreft = import_pyreft()
    from transformers import PreTrainedTokenizerFast, Trainer, TrainingArguments

    if "tokenizer" in inspect.signature(Trainer.__init__).parameters:
        pytest.skip("this transformers takes tokenizer= itself")
    tokenizer, model = PreTrainedTokenizerFast(tokenizer_object=_tiny_tokenizer()), reft_model(tiny_llama())
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = pyreft.ReftTrainerForCausalLM(model=model, tokenizer=tokenizer, args=args)
    assert trainer.processing_class is tokenizer
    with pytest.raises(TypeError, match="ReftTrainerForCausalLM: pass tokenizer= or processing_class=, not both"):
        pyreft.ReftTrainerForCausalLM(model=model, tokenizer=tokenizer, processing_class=tokenizer, args=args)
    with pytest.raises(TypeError, match="tokenizer"):  # HF Trainer for everyone else: as it is
        Trainer(model=model.model, tokenizer=tokenizer, args=args)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
