"""DeepSpeed ZeRO 1/2/3 (CPU over gloo here; 2 x H200 with offload on the GPU machine)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import helpers
from pyvene_dist.testing import ParityCase, assert_parity, differences, tolerance, train
from pyvene_dist.testing.runners import DeepSpeed

pytest.importorskip("deepspeed")
NO_LIBAIO = helpers.libaio_missing()  # why NVMe offload cannot run here, or None

STAGES = ["zero1", "zero2", "zero3", "zero3-offload"]  # offload: parameters and optimizer state in host memory


@pytest.mark.world_size(1, 2, timeout=600)
@pytest.mark.parametrize("strategy", STAGES)
def test_zero_matches_one_process(strategy):
    helpers.patch()
    case = ParityCase()
    candidate = train(case, strategy)
    if dist.get_rank() == 0:
        reference = train(case, "single")
        print(f"{strategy}: {differences(reference, candidate)}; parameter bytes on rank 0 "
              f"{candidate.parameter_bytes} of {reference.parameter_bytes}")
        assert_parity(reference, candidate, case.tolerance)


@pytest.mark.world_size(2, timeout=600)
@pytest.mark.parametrize("strategy", ["zero2", "zero3", "zero3-offload"])
def test_zero_in_bf16_matches_one_process(strategy):
    """DeepSpeed's bf16 engine used to fail at the first forward: ``"orgqr_cpu" not implemented for
    'BFloat16'`` (the rotation cast to bf16 has no Householder kernel; fixes.parametrizations)."""
    helpers.patch()
    # lr 1e-3, as the other bf16 comparisons: at 1e-2 Adam turns rounding into steps of lr (parity.DEEPSPEED_BF16)
    case = ParityCase(dtype="bfloat16", lr=1e-3)
    candidate = train(case, strategy)
    if dist.get_rank() == 0:
        reference = train(case, "single")
        print(f"{strategy} bf16: {differences(reference, candidate)}")
        # 8 bf16 ulps; a final weight also 2 x lr off per step its reference gradient was within them of zero
        assert_parity(reference, candidate, dataclasses.replace(tolerance(case, strategy), adam_lr=case.lr))


@pytest.mark.world_size(2, timeout=900)
@pytest.mark.skipif(NO_LIBAIO is not None, reason=str(NO_LIBAIO))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zero3_nvme_offload_matches_zero3_in_memory(tmp_path, dtype):
    """Parameters and optimizer state swapped to files (ZeRO-Infinity); the first run compiles the async_io op.

    DeepSpeed swaps a partition only from 1 MiB up (``MIN_AIO_BYTES``), hence hidden 1024: the base model's
    matrices are swapped; the interventions (4 x 1024) and their optimizer state stay in host memory. The
    backward runs through 3 frozen layers above the lowest intervention, which with DeepSpeed's default reuse
    settings hold more swap buffers (21 matrices) than there are (16). At this size two ranks' float32 sums
    differ from one device's by 7e-5 under plain DDP too, so the reference is ZeRO-3 with everything in
    memory, which reduces in the same order: swapping must change nothing."""
    import os

    helpers.use_libaio()
    helpers.patch()
    case = ParityCase(hidden_size=1024, num_layers=6, layers=(2, 4), dtype=dtype)
    folder = tmp_path / f"nvme-rank{os.environ['RANK']}"
    strategy = DeepSpeed(3, offload="nvme", nvme_path=str(folder))
    candidate = train(case, strategy)
    swapped = list(folder.glob("zero_stage_3/*params/rank*/*.swp"))
    large = [p for p in strategy.engine.module.parameters() if p.ds_tensor.ds_numel * p.element_size() >= 2**20]
    print(f"rank {os.environ['RANK']}: {len(swapped)} swap files, {len(large)} partitions of 1 MiB or more")
    assert len(large) > 0 and len(swapped) == len(large)
    in_memory = train(case, "zero3")
    if dist.get_rank() == 0:
        print(f"zero3-nvme {dtype} vs zero3: {differences(in_memory, candidate)}")
        assert_parity(in_memory, candidate, case.tolerance)


@pytest.mark.world_size(2, timeout=600)
def test_zero3_partitions_the_base_model_and_the_interventions():
    import deepspeed

    helpers.patch()
    case = ParityCase()
    model = case.build()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.get_trainable_parameters()),
                                      config=DeepSpeed(3).config(case.batch_size))
    parameters = list(model.parameters())
    partitioned = [p for p in parameters if hasattr(p, "ds_id") and p.ds_tensor.numel() < p.ds_numel]
    assert len(parameters) == 27 and len(partitioned) == len(parameters)
    # Sizes are reported whole, not as the (empty) local view: the interventions', and with the base's
    # trainable part, the head (the vocabulary of 97 x hidden 32) beside them.
    assert model.count_parameters() == 2 * (32 * 4 + 4 * 32 + 4)
    assert model.count_parameters(include_model=True) == model.count_parameters() + 97 * 32


@pytest.mark.world_size(2, timeout=600)
@pytest.mark.parametrize("intervention", ["NoreftIntervention", "DireftIntervention"])
def test_interventions_reading_other_modules_weights_under_zero3(intervention):
    helpers.patch()
    case = ParityCase(intervention=intervention, rank=8)
    strategy = DeepSpeed(3)
    candidate = train(case, strategy)
    # Nothing of the interventions stays gathered after the steps: each rank keeps its partition only.
    for parameter in strategy.engine.module.interventions.parameters():
        assert parameter.data.numel() == 0 and 0 < parameter.ds_tensor.numel() < parameter.ds_numel
    if dist.get_rank() == 0:
        assert_parity(train(case, "single"), candidate, case.tolerance)


@pytest.mark.world_size(2, timeout=600)
def test_zero3_saves_whole_weights_once_and_loads_them(tmp_path):
    """The interventions and the trained head (``lm_head``, trainable beside them) are partitioned: each is
    saved whole by ``save_intervention`` and by ``save(include_model=True)`` (pyreft's ``ReftModel.save``),
    loads on one device, and back into a partitioned model. The head used to be saved as the empty
    partition (``size mismatch for lm_head.weight: copying a param with shape torch.Size([0])``), and
    ``save`` wrote the interventions' empty partitions too."""
    import deepspeed
    import pyreft

    from pyvene_dist.testing import models
    from pyvene_dist.testing.comparison import trained_parameters

    helpers.patch()
    case = ParityCase()
    trained = train(case, "single")  # the weights to save, same on every rank
    model = case.build()
    for name, parameter in trained_parameters(model):
        parameter.data.copy_(trained.weights[name])
    deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.get_trainable_parameters()),
                         config=DeepSpeed(3).config(case.batch_size))
    model.save_intervention(str(tmp_path / "saved"))  # every rank calls; rank 0 writes
    model.save(str(tmp_path / "pyreft"), include_model=True)
    dist.barrier()
    single = ParityCase(seed=9).build()
    single.load_intervention(str(tmp_path / "saved"))
    for name, parameter in trained_parameters(single):
        assert torch.equal(parameter, trained.weights[name]), name
    loaded = pyreft.ReftModel.load(str(tmp_path / "pyreft"), models.tiny_llama(seed=9), include_model=True)
    for name, parameter in loaded.interventions.named_parameters():
        assert torch.equal(parameter, trained.weights[name]), name
    assert torch.equal(loaded.model.lm_head.weight, trained.weights["model.lm_head.weight"])
    # ... and back into a partitioned model
    other = ParityCase(seed=9).build()
    deepspeed.initialize(model=other, optimizer=torch.optim.AdamW(other.get_trainable_parameters()),
                         config=DeepSpeed(3).config(case.batch_size))
    other.load_intervention(str(tmp_path / "saved"))
    from deepspeed.utils import safe_get_full_fp32_param

    for name, parameter in trained_parameters(other):
        torch.testing.assert_close(safe_get_full_fp32_param(parameter).cpu(), trained.weights[name], rtol=0, atol=0)
        with deepspeed.zero.GatheredParameters([parameter]):
            assert torch.equal(parameter.data, trained.weights[name]), name


@pytest.mark.world_size(2, timeout=600)
@pytest.mark.parametrize("stage", ["2", "3"])
def test_accelerate_deepspeed_plugin_matches_one_process(stage):
    """The config's ``"gradient_accumulation_steps": "auto"`` takes the Accelerator's: the engine steps once
    per ``case.accumulation`` micro-batches, as one process does."""
    from accelerate import Accelerator, DeepSpeedPlugin

    from pyvene_dist.testing.hf import deepspeed_config, train_with_accelerate

    helpers.patch()
    case = ParityCase()
    plugin = DeepSpeedPlugin(hf_ds_config=deepspeed_config(stage))
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=case.accumulation,
                              cpu=not torch.cuda.is_available())
    candidate = train_with_accelerate(case, accelerator)
    if dist.get_rank() == 0:
        assert_parity(train(case, "single"), candidate, case.tolerance, grads=False)


TRAINER_STAGES = [
    pytest.param("1", id="zero1"),
    pytest.param("2", id="zero2"),
    pytest.param("3", id="zero3-from_pretrained-under-zero.Init"),
    pytest.param("3-offload", id="zero3-offload", marks=pytest.mark.gpus(2)),
]
#: The stages every machine runs, made in one launch (the others, which need GPUs, each in a launch of its own).
LAUNCHED_TOGETHER = ("1", "2", "3")


@pytest.fixture(scope="module")
def trainer_stages(tmp_path_factory):
    """stage -> the Record of train_with_trainer.py ``--deepspeed stage`` under torchrun with 2 processes. The stages
    of LAUNCHED_TOGETHER are made in one launch, one after the other in the same processes (launchers.launch_runs;
    ZeRO-3 last, and HF's DeepSpeed config is unset after each run), by the first test that asks: each launched
    process imports torch, transformers and pyvene once, and each run gives the Record it gives when launched alone."""
    from launchers import SCRIPTS, launch_runs
    from pyvene_dist.testing.launch import free_port

    folder = tmp_path_factory.mktemp("trainer-stages")
    launched = {}

    def get(stage):
        if stage not in launched:
            stages = LAUNCHED_TOGETHER if stage in LAUNCHED_TOGETHER else (stage,)
            torchrun = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                        str(SCRIPTS / "train_with_trainer.py")]
            record, _ = launch_runs(folder, torchrun, [("--deepspeed", name) for name in stages])
            launched.update({name: (lambda number=number: record(number)) for number, name in enumerate(stages)})
        return launched[stage]()
    return get


@pytest.mark.slow
@pytest.mark.ranks(2)  # torchrun's rank 1 takes cuda:1: "device_id cuda:1 is out of range" on a one-GPU machine
@pytest.mark.parametrize("stage", TRAINER_STAGES)
def test_hf_trainer_deepspeed_under_torchrun_matches_one_process(trainer_stages, stage, patched):
    """The reference is one patched process (``patched``), as the script's ranks are: stock pyvene's
    ``zero_grad`` keeps the trainable head's gradients summing from step to step (``fixes.zero_grad``; the
    third loss is then 1.5e-3 off)."""
    record = trainer_stages(stage)
    case = ParityCase()
    print(f"HF Trainer DeepSpeed {stage}: {record.losses}")
    assert record.world_size == 2
    assert_parity(train(case, "single"), record, case.tolerance, grads=False)


@pytest.mark.world_size(2, timeout=120)
def test_zero3_save_on_rank_0_alone_is_refused_in_seconds(tmp_path):
    """pyreft's multi-GPU example saves under ``if rank == 0``; under ZeRO-3 that used to hang in the gather."""
    import time

    import deepspeed

    from pyvene_dist import gather

    helpers.patch()
    gather.ARRIVAL_TIMEOUT_S = 3.0
    case = ParityCase()
    model = case.build()
    deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.get_trainable_parameters()),
                         config=DeepSpeed(3).config(case.batch_size))
    if dist.get_rank() == 0:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="call save_intervention / load_intervention .* on every rank") as error:
            model.save_intervention(str(tmp_path / "saved"))
        # the largest of what is split: the trainable head, 97 x 32 elements (the interventions' 32 x 4 with
        # the head frozen), named in the error
        assert '"stage3_param_persistence_threshold" of at least 3104' in str(error.value)
        assert "lm_head.weight" in str(error.value)
        assert time.monotonic() - started < 60
    dist.barrier()


@pytest.mark.world_size(2, timeout=180)
def test_zero3_saves_from_rank_0_alone_when_it_keeps_the_interventions_whole(tmp_path):
    """pyreft's multi-GPU example trains, then saves under ``if rank == 0`` (``save_intervention``, and
    pyreft's ``ReftModel.save``). Under DeepSpeed's default ``stage3_param_persistence_threshold``
    (100,000 elements) ZeRO-3 keeps interventions this small whole on every rank from their first forward
    on, so rank 0 saves alone, with no gather: the files hold the trained weights. A gather attempted alone
    would raise here after 3 s. Reading LoReFT's rotation must not run ZeRO's module hooks on rank 0 alone
    either: the ranks then trained on out of step, and the next step's gather hung."""
    from pyvene_dist import gather
    from pyvene_dist.fixes.checkpoints import STATES_FILE
    from pyvene_dist.testing.training import summed_loss

    helpers.patch()
    gather.ARRIVAL_TIMEOUT_S = 3.0
    case = ParityCase()
    strategy = DeepSpeed(3, zero={"stage3_param_persistence_threshold": 100_000})
    trained = train(case, strategy)
    model, saved = strategy.engine.module, tmp_path / "saved"
    if dist.get_rank() == 0:  # the head (97 x 32 elements) is persistent too, whole on every rank
        model.save_intervention(str(saved))
        model.save(str(tmp_path / "pyreft"), include_model=True)  # pyvene's save, which pyreft's ReftModel.save is
        states = torch.load(saved / STATES_FILE, weights_only=True)
        head = torch.load(saved / "pytorch_model.bin", weights_only=True)
        head = {f"model.{name}": value for name, value in head.items()}
        saved_by_save = torch.load(tmp_path / "pyreft" / "pytorch_model.bin", weights_only=True)
        assert set(head) == {"model.lm_head.weight"}, sorted(head)
        assert set(trained.weights) <= set(states) | set(head)
        for name, value in trained.weights.items():
            assert torch.equal({**states, **head}[name], value), name
        assert torch.equal(saved_by_save["lm_head.weight"], trained.weights["model.lm_head.weight"])
    dist.barrier()
    for batch in case.batches(steps=1):  # every rank trains on, in step (the engine counts the micro-batches)
        strategy.backward(summed_loss(strategy.engine, strategy.shard(batch), strategy.device))
        strategy.step(None, strategy.engine)


@pytest.mark.world_size(2, timeout=600)
def test_interventions_on_a_model_partitioned_by_zero_init_take_its_bf16():
    """HF's order under ZeRO-3 (``TrainingArguments``, then ``from_pretrained`` under ``zero.Init``) in bf16:
    the base is partitioned in bf16 and DeepSpeed casts nothing more, while LoReFT's rotation is built in
    float32; without the fix ``deepspeed.initialize`` fails with an AssertionError in stage 3's defragment."""
    import deepspeed
    import pyreft
    from transformers import LlamaConfig, LlamaForCausalLM

    helpers.patch()
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
        base = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=4))
    intervention = pyreft.LoreftIntervention(embed_dim=32, low_rank_dimension=4, dtype=torch.bfloat16)
    model = pyreft.get_reft_model(base, pyreft.ReftConfig(representations=[
        {"layer": 1, "component": "block_output", "low_rank_dimension": 4, "intervention": intervention}]))
    assert {p.dtype for p in model.interventions.parameters() if p.requires_grad} == {torch.bfloat16}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.get_trainable_parameters()),
                                      config=config)
    input_ids = torch.randint(97, (2, 6), generator=torch.Generator().manual_seed(dist.get_rank()))
    _, out = engine({"input_ids": input_ids}, unit_locations={"sources->base": (None, [[[5], [5]]])}, labels=input_ids)
    engine.backward(out.loss)
    engine.step()
    assert torch.isfinite(out.loss)


@pytest.mark.gpus(1)
@pytest.mark.world_size(1, timeout=600)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zero3_with_replayed_rotations_matches_eager_rotations(dtype):
    """On a GPU, LoReFT's rotation of a ZeRO-3 partition replays from CUDA graphs (in DeepSpeed's bf16 mode
    through a float32 copy of the matrix: fixes.orthogonal's staged graphs): losses, gradients and weights
    match those of the eager rotation."""
    import pyvene_dist
    from pyvene_dist.mechanisms import rotation_graphs

    case = ParityCase(dtype=dtype, lr=1e-3) if dtype == "bfloat16" else ParityCase()
    staged, capture, warm_calls = [], rotation_graphs._Graphs.capture, rotation_graphs.WARM_CALLS

    def counted_capture(graphs, *args):
        staged.append(graphs.staged)
        return capture(graphs, *args)

    runs = {}
    try:
        rotation_graphs._Graphs.capture, rotation_graphs.WARM_CALLS = counted_capture, 1
        for cuda_graphs in (False, True):
            pyvene_dist.unpatch()
            pyvene_dist.patch(cuda_graphs=cuda_graphs)
            runs[cuda_graphs] = train(case, "zero3")
    finally:
        rotation_graphs._Graphs.capture, rotation_graphs.WARM_CALLS = capture, warm_calls
        pyvene_dist.unpatch()
    assert staged, "no rotation was captured"
    if dtype == "bfloat16":  # float32: at world 1 the gathered matrix keeps its storage, read in place
        assert all(staged), f"captures (staged or not): {staged}"
    print(f"zero3 {dtype}, replayed against eager: {differences(runs[False], runs[True])}")
    assert_parity(runs[False], runs[True], case.tolerance)


def test_a_load_onto_a_zero3_half_precision_base_takes_its_dtype(patched, tmp_path):
    """pyvene's load restores each intervention's saved dtype (float32 here); onto a base ZeRO-3 partitioned in
    bf16 (``zero.Init`` marks each parameter with ``ds_id``) the interventions then take bf16 again, as
    ``deepspeed.initialize`` needs (stage 3's defragment asserts one dtype). Checked on the load's result
    directly: pyreft's ReftModel.load builds a new model, whose __init__ would give it the dtype anyway."""
    import pyvene

    from pyvene_dist.testing import models

    models.reft_model(models.tiny_llama(), layers=(0,)).save(str(tmp_path))
    base = models.tiny_llama(dtype=torch.bfloat16)
    for parameter in base.parameters():
        parameter.ds_id = 0  # as zero.Init marks a partitioned parameter
    loaded = pyvene.IntervenableModel.load(str(tmp_path), base)
    assert {p.dtype for p in loaded.interventions.parameters()} == {torch.bfloat16}
