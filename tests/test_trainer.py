"""The trainer end to end (launch/pretrain.py under python and torchrun/gloo): exact resume, crash
safety, data-parallel parity, ViT freeze schedule, config refusal. The runs are flash_tiny on the
8-layer plan of tests/layer_plans.py (each CSA2 role, both Engram modules), not the 40 layers: the
layouts and the resume do not depend on the depth, and the runs cost a fifth."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import warm_launch
from layer_plans import EIGHT_LAYERS

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus_args(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    return [f"data.corpus_dir={d}", "data.corpus_text_bytes=1500000", "data.corpus_mm_docs=800", "data.corpus_shards=8"]


# unfreeze the ViT at 0-based step ceil(1200 / 512) = 3 (the 4th), so resuming after 2 steps crosses it
SCHEDULE = ["schedule.warmup_fraction=0.002", "schedule.decay_start_fraction=0.006", "schedule.decay_end_fraction=0.5",
            "data.mix=[1,1]",  # plenty of images in every step, so the unfrozen ViT body surely gets gradients
            "train.grad_clip=0.5"]  # the gradient norms are ~0.8 here: every step is clipped
GRAD_CLIP = 0.5
# held-out evaluation after steps 2 and 4: 512 positions, 4 one-sequence micro-batches (data.mix [1, 1]:
# 2 text, 2 multimodal), the default corpus's held-out part
EVAL = ["train.eval.interval=2", "train.eval.tokens=512"]


@pytest.fixture(scope="module")
def one_sequence_reference(tmp_path_factory, corpus_args):
    """One process, one-sequence micro-batches (4 per step), 4 steps, a checkpoint after each: what the
    pipeline and context-parallel layouts must reproduce. Returns the run directory and its records."""
    run = tmp_path_factory.mktemp("one_sequence_reference")
    pretrain(run, corpus_args, "train.max_steps=4", "train.checkpoint.interval=1", "train.checkpoint.keep=4",
             "data.batch_size=1", *EVAL)
    return run, records(run)


@pytest.fixture(scope="module")
def two_reader_reference(tmp_path_factory, corpus_args):
    """One process, 2 loader workers (two 2-sequence micro-batches per step), 4 steps, a checkpoint after
    each: the straight run that resuming, surviving a kill and 2-rank data parallelism must reproduce.
    Returns the run directory and its records."""
    run = tmp_path_factory.mktemp("two_reader_reference")
    pretrain(run, corpus_args, "train.max_steps=4", "data.num_workers=2", "train.checkpoint.interval=1",
             "train.checkpoint.keep=4", *EVAL)
    return run, records(run)


@pytest.fixture(scope="module")
def four_reader_reference(tmp_path_factory, corpus_args):
    """One process, 4 loader workers, one-sequence micro-batches, 4 steps, a checkpoint after each: the
    global batch that 4 readers (4 data-parallel ranks x 1 worker, or 2 x 2) read. Returns the run
    directory and its records."""
    run = tmp_path_factory.mktemp("four_reader_reference")
    pretrain(run, corpus_args, "train.max_steps=4", "data.num_workers=4", "data.batch_size=1",
             "train.checkpoint.interval=1", "train.checkpoint.keep=4", *EVAL)
    return run, records(run)


# AdamW parameters whose gradients are rounding-level while the 4 mHC streams are still nearly identical
ROUNDING_DRIVEN = ("hc_attn_base", "hc_attn_scale", "hc_ffn_base", "hc_ffn_scale")
ADAMW_MAX_STEP = 1.17  # |m_hat / sqrt(v_hat)| <= (1 - b1) / sqrt(1 - b2) / sqrt(1 - b1^2 / b2) for b = (0.9, 0.95)


def assert_params_close(got, ref_run, ref_records, step, rel=0.1):
    """For runs that are equal only up to rounding (gradients summed in another order), at `step`:
    every parameter tensor differs from the reference by at most `rel` of how far the reference moved
    it since step 1 (a tensor that did not move must be equal). The exception is the mHC bases and
    scales: AdamW normalises their rounding-level gradients into lr-sized steps of either sign, so two
    runs may part by up to twice the largest AdamW step per element and step, and no more.
    Bit-identical runs (resume) compare with torch.equal instead."""
    ref, _ = final_model(ref_run, step)
    first, _ = final_model(ref_run, 1)
    lr_sum = sum(r["lr"] for r in ref_records[:step])
    assert got.keys() == ref.keys()
    for k in ref:
        diff = got[k].double() - ref[k].double()
        if k.endswith(ROUNDING_DRIVEN):
            assert diff.abs().max().item() <= 2 * ADAMW_MAX_STEP * lr_sum, f"{k}: differs by {diff.abs().max():.3g}"
            continue
        moved = (ref[k].double() - first[k].double()).norm().item()
        assert diff.norm().item() <= rel * moved, (f"{k}: differs by {diff.norm():.3g}, the reference moved it "
                                                   f"by {moved:.3g}")


def assert_grad_norms_close(x, y, rel=1e-5):
    """Two layouts' grad norms at one step (records x, y): to `rel` at step 1, where both start from the same
    weights; from step 2 on to 1e-3, because by then the ROUNDING_DRIVEN mHC bases and scales may have parted by
    lr-sized AdamW steps (`assert_params_close`) and the gradients follow them: 9e-5 apart at step 3 of the
    pipeline test on a Xeon with AMX (2026-12-07), where the summation order of one process and of a pipeline
    rounded those tensors' gradients to opposite signs."""
    assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=rel if x["step"] == 1 else max(rel, 1e-3))


def assert_records_match(ref, got):
    """Two runs of the same 4 steps in other layouts (equal up to summation order): losses, aux values and
    grad norms to rounding, expert loads and padding exactly."""
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for x, y in zip(ref, got):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6)
        assert y["balance_loss"] == pytest.approx(x["balance_loss"], rel=1e-5)
        assert y["indexer_loss"] == pytest.approx(x["indexer_loss"], rel=1e-4, abs=1e-7)
        assert_grad_norms_close(x, y)
        assert y["expert_load"] == x["expert_load"]
        assert y["padding_fraction"] == x["padding_fraction"]
        assert y["per_source"].keys() == x["per_source"].keys() == {"text", "mm"}
        for k, a in x["per_source"].items():  # tokens read exactly; the loss of each source's labels to rounding
            b = y["per_source"][k]
            assert b["tokens_seen"] == a["tokens_seen"]
            assert (b["loss"] is None) == (a["loss"] is None) and b["loss"] == pytest.approx(a["loss"], rel=1e-6)


def assert_evals_match(ref_run, run, steps):
    """The eval records of a run in another layout (train/evaluation/heldout.py): the reference's at `steps`, within
    1e-5 relative (summation order), the scored tokens exactly."""
    ref, got = evals(ref_run), evals(run)
    assert [e["step"] for e in got] == list(steps)
    for y in got:
        assert_evals_match_one(next(e for e in ref if e["step"] == y["step"]), y)


def assert_evals_match_one(x, y):
    assert y["step"] == x["step"] and y["tokens"] == x["tokens"]
    assert y["per_source"].keys() == x["per_source"].keys() == {"text", "mm"}
    for a, b in [(x, y)] + [(x["per_source"][k], y["per_source"][k]) for k in x["per_source"]]:
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["bpb"] == pytest.approx(a["bpb"], rel=1e-5)
        assert b["tokens"] == a["tokens"]


def assert_clipped(recs):
    assert all(r["grad_norm"] > GRAD_CLIP for r in recs), [r["grad_norm"] for r in recs]  # clipping was active


def pretrain(run_dir, corpus_args, *overrides, procs=1, env=None, check=True, timeout=600, plan=EIGHT_LAYERS):
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
           if procs > 1 else [sys.executable])
    cmd += [str(ROOT / "launch" / "pretrain.py"), "+exp=flash_tiny", *plan, f"hydra.run.dir={run_dir}",
            "logging.wandb.mode=disabled", "logging.progress=false", "logging.heatmap_interval=0", *SCHEDULE,
            *corpus_args, *overrides]
    out = warm_launch.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **(env or {})})
    if check:
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def records(run_dir):
    """The step records of metrics.jsonl (not its events)."""
    return [r for r in _lines(run_dir) if "event" not in r]


def evals(run_dir):
    """The eval events of metrics.jsonl."""
    return [r for r in _lines(run_dir) if r.get("event") == "eval"]


def _lines(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def final_model(run_dir, step):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = Path(run_dir) / f"final_{step}.pt"
    dcp_to_torch_save(str(Path(run_dir) / "checkpoints" / f"step_{step:08d}"), str(out))
    state = torch.load(out, weights_only=False)
    return state["model"], state["optim"]


@pytest.mark.slow
@pytest.mark.xdist_group("trainer_two_reader_reference")
def test_exact_resume_across_the_vit_unfreeze(tmp_path, corpus_args, two_reader_reference):
    """Stopped after 2 steps and resumed, bit-identical to 4 straight steps: one process with 2 loader
    workers (their reading positions restored) against the shared reference. (2 ranks reading in their
    main processes, resumed bit-identically: the crash fuzz, tests/test_reliability.py, whose every restart
    is one.)"""
    resumed = tmp_path / "resumed"
    straight, readers = two_reader_reference[0], ["data.num_workers=2"]
    pretrain(resumed, corpus_args, "train.max_steps=2", *readers, *EVAL)
    second = pretrain(resumed, corpus_args, "train.max_steps=4", *readers, *EVAL)
    assert f"resumed from {resumed}/checkpoints/step_00000002 at step 2" in second.stdout
    a, b = records(straight), records(resumed)
    assert [r["step"] for r in a] == [1, 2, 3, 4] and [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["per_source"] for r in a] == [r["per_source"] for r in b]  # the per-source counts carried over
    assert [e["step"] for e in evals(straight)] == [2, 4] and evals(resumed) == evals(straight)  # exactly
    assert [r["vit_trainable"] for r in a] == [False, False, False, True]  # 0-based step 3 = the 4th
    ma, oa = final_model(straight, 4)
    mb, ob = final_model(resumed, 4)
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert oa.keys() == ob.keys() and all(torch.equal(oa[k], ob[k]) for k in oa)
    # the ViT body gained optimizer state only once unfrozen, and the MoE biases moved
    assert any(".vision.blocks.0.attn.wqkv.weight." in k for k in oa)
    assert any(ma[k].abs().sum() > 0 for k in ma if k.endswith("ffn.gate.bias"))


@pytest.mark.slow
@pytest.mark.xdist_group("trainer_two_reader_reference")
def test_data_parallel_parity(tmp_path, corpus_args, two_reader_reference):
    """Same global batch: 1 rank with 2 loader workers (2 accumulated micro-batches, the shared reference)
    vs 2 ranks with 1 each, for 3 steps."""
    pretrain(tmp_path / "dp2", corpus_args, "train.max_steps=3", "data.num_workers=1",
             "train.checkpoint.async_save=true", procs=2)  # also: a background save on its own gloo group
    a, b = two_reader_reference[1][:3], records(tmp_path / "dp2")
    assert [r["step"] for r in b] == [1, 2, 3]
    assert_clipped(a)
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6)
        assert_grad_norms_close(x, y, rel=1e-4)
        assert x["tokens_seen"] == y["tokens_seen"]
        assert x["expert_load"] == y["expert_load"]
    assert (tmp_path / "dp2" / "checkpoints" / "step_00000003" / ".metadata").is_file()


@pytest.mark.slow
@pytest.mark.xdist_group("trainer_two_reader_reference")
def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, corpus_args, two_reader_reference):
    run = tmp_path / "crash"
    # its 2 loader workers die with it: survivors would hold its output pipes (this call would wait for
    # ever) and the run directory's lock (the restart below would be refused)
    killed = pretrain(run, corpus_args, "train.max_steps=3", "train.checkpoint.interval=1", "data.num_workers=2",
                      env={"FLASHTRAIN_FAULT": "kill:rank=0:step=2:point=checkpoint_write"}, check=False, timeout=300)
    assert killed.returncode != 0
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == [".tmp-step_00000002", "step_00000001"]  # the half-written one never got its final name
    again = pretrain(run, corpus_args, "train.max_steps=3", "train.checkpoint.interval=1", "data.num_workers=2")
    assert f"resumed from {run}/checkpoints/step_00000001 at step 1" in again.stdout
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001", "step_00000002",
                                                                        "step_00000003"]
    straight = two_reader_reference[1]
    assert [r["loss"] for r in straight][1:3] == [r["loss"] for r in records(run)][-2:]


@pytest.mark.slow
def test_named_sources_report_per_source_and_resume_with_changed_weights(tmp_path, corpus_args, tiny_cfg):
    """data.sources end to end: three sources cut from the default corpus (web, code: text; caps:
    multimodal), 5 : 3 : 2; every record has each source's tokens read and loss, and the positions add up
    to the rows' (with the padding); a resume with other weights is allowed, logged, and counts on."""
    from flashtrain.data.config import DataConfig
    from flashtrain.data.corpus import ensure_default_corpus
    from flashtrain.train.config import token_spec

    given = dict(a.removeprefix("data.").split("=") for a in corpus_args)
    c = ensure_default_corpus(DataConfig(**{k: v if k == "corpus_dir" else int(v) for k, v in given.items()}),
                              token_spec(tiny_cfg))

    def sources(w):
        return ("data.sources=[" + ",".join(
            f"{{name:{n},shards:['{c}/{pat}'],weight:{x},modality:{m}}}"
            for (n, pat, m), x in zip((("web", "text-0000[0-3].tar", "text"), ("code", "text-0000[4-7].tar", "text"),
                                       ("caps", "mm-*.tar", "multimodal")), w)) + "]")

    run = tmp_path / "run"
    common = ("data.mix=null", f"data.val_shards=['{c}/val-*.tar']", *EVAL)
    pretrain(run, corpus_args, "train.max_steps=2", sources((5, 3, 2)), *common)
    second = pretrain(run, corpus_args, "train.max_steps=3", sources((1, 1, 1)), *common)
    assert "data sources changed at this resume" in second.stdout + second.stderr
    recs = records(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["per_source"].keys() == {"web", "code", "caps"}
        assert all(v["loss"] is None or 0 < v["loss"] < 10 for v in r["per_source"].values())
    rows = 4 * 129  # 512 tokens per step: 4 rows of seq_len + 1 = 129 positions
    for before, r in zip([{"web": {"tokens_seen": 0}, "code": {"tokens_seen": 0}, "caps": {"tokens_seen": 0}}]
                         + [x["per_source"] for x in recs], recs):
        read = sum(v["tokens_seen"] - before[k]["tokens_seen"] for k, v in r["per_source"].items())
        assert read == round(rows * (1 - r["padding_fraction"]))
    assert [e["step"] for e in evals(run)] == [2] and evals(run)[0]["per_source"].keys() == {"text", "mm"}


@pytest.mark.slow
@pytest.mark.xdist_group("trainer_one_sequence_reference")
def test_bad_batch_and_changed_model_are_refused(tmp_path, corpus_args, one_sequence_reference):
    """A global batch that is no whole number of micro-batches is refused before anything is built (in process,
    as test_bad_pipeline_and_context_layouts_...); resuming the reference's checkpoint with another model
    config is refused naming the changed field, while a field that changes only the execution resumes."""
    from flashtrain.config.errors import ConfigError
    from flashtrain.train.build import read_configs, run_plan
    from flashtrain.train.config import compose

    with pytest.raises(ConfigError, match=r"train.global_batch_tokens=384.*data.batch_size=2"):
        run_plan(read_configs(compose(["+exp=flash_tiny", *EIGHT_LAYERS, "train.global_batch_tokens=384"])), 1)
    ckpt = f"{one_sequence_reference[0]}/checkpoints/step_00000002"
    other = pretrain(tmp_path / "other", corpus_args, "train.max_steps=3", f"train.resume_from={ckpt}",
                     "data.batch_size=1", "model.init_std=0.01", "model.dim=96", "model.attn_chunk_size=32",
                     check=False)
    assert other.returncode == 2 and (  # refused for the config, before a tensor of another shape fails to load
        f"error: checkpoint {ckpt} was written for a different model config (fields ['dim', 'init_std'] differ); use "
        f"a new run directory, or the model config it was trained with") in other.stderr.splitlines(), other.stderr
    assert not (tmp_path / "other").exists()  # refused after the model was built: nothing written (issue 47 item 2)
    assert "attn_chunk_size" not in other.stderr.split("different model config")[1].split("\n")[0]
    again = pretrain(tmp_path / "again", corpus_args, "train.max_steps=3", f"train.resume_from={ckpt}",
                     "data.batch_size=1", "model.attn_chunk_size=32")  # execution only: resumes
    assert f"resumed from {ckpt} at step 2" in again.stdout


@pytest.mark.slow
@pytest.mark.parametrize("async_save", ["false", "true"])
def test_keep_last_k_and_resume_from(tmp_path, corpus_args, async_save):
    run = tmp_path / "keep"
    pretrain(run, corpus_args, "train.max_steps=3", "train.checkpoint.interval=1", "train.checkpoint.keep=2",
             f"train.checkpoint.async_save={async_save}")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]
    other = tmp_path / "other"
    out = pretrain(other, corpus_args, "train.max_steps=3", f"train.resume_from={run}/checkpoints/step_00000002")
    assert f"resumed from {run}/checkpoints/step_00000002 at step 2" in out.stdout
    assert records(other)[-1]["loss"] == records(run)[-1]["loss"]
    job_log = (other / "pretrain.log").read_text()  # the job log receives the trainer's log lines, those of the
    assert "resumed from" in job_log and f"run directory {other}: 1 process(es)" in job_log  # start-up too
    # the admitted start's config record (train/runtime/run_record.py): what Hydra wrote before
    assert f"- train.resume_from={run}/checkpoints/step_00000002\n" in (other / ".hydra" / "overrides.yaml").read_text()
    assert "max_steps: 3" in (other / ".hydra" / "config.yaml").read_text()
    assert "job:\n    name: pretrain" in (other / ".hydra" / "hydra.yaml").read_text()


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(tmp_path, corpus_args):
    import signal
    import time

    run = tmp_path / "term"
    cmd = [sys.executable, str(ROOT / "launch" / "pretrain.py"), "+exp=flash_tiny", *EIGHT_LAYERS,
           f"hydra.run.dir={run}", "logging.wandb.mode=disabled", "logging.progress=false", "train.max_steps=200",
           *SCHEDULE, *corpus_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text()):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    last = records(run)[-1]["step"]
    assert f"SIGTERM: saved step {last}, exiting" in out
    assert (run / "checkpoints" / f"step_{last:08d}" / ".metadata").is_file() and last < 200


def test_expert_load_statistics_by_hand():
    import math

    from flashtrain.train.metrics import finite_or_none, load_statistics

    loads = {0: torch.tensor([[2, 2, 2, 2], [0, 0, 0, 0]]), 1: torch.tensor([[4, 0, 0, 0], [1, 3, 0, 0]])}
    s = load_statistics(loads)
    assert s["text"]["max_over_mean"] == [1.0, 4.0] and s["text"]["cv"][0] == 0.0
    assert s["text"]["cv"][1] == pytest.approx(math.sqrt(3))  # values 4,0,0,0: mean 1, std sqrt(3)
    assert math.isnan(s["image"]["max_over_mean"][0]) and s["image"]["max_over_mean"][1] == 3.0
    assert finite_or_none(s)["image"]["max_over_mean"] == [None, 3.0]  # metrics.jsonl writes an absent modality as null
    # the heatmap title's routed assignments: the largest layer's count per modality (every layer routes the same
    # tokens), not the sum over layers: text max(8, 4) = 8, image max(0, 4) = 4
    from flashtrain.train.metrics import routed_counts

    assert routed_counts(loads) == {"text": 8, "image": 4} and routed_counts({}) == {"text": 0, "image": 0}


@pytest.mark.slow
@pytest.mark.xdist_group("trainer_one_sequence_reference")
def test_pipeline_trains_like_one_process_and_resumes_across_layouts(tmp_path, corpus_args, one_sequence_reference):
    """flash_tiny, 4 one-sequence micro-batches per step: pp=1 straight vs (pp=2 1F1B, 2 steps, then
    pp=1) and (pp=1, 2 steps, then pp=2 DualPipeV, stage 0 + 3 on rank 0, with train.recompute=full
    under its split input / weight backward): the same losses, grad norms
    and expert loads at every step, checkpoints loading across the layouts."""
    one = ["data.batch_size=1"]
    straight, ref = one_sequence_reference
    ma, _ = final_model(straight, 4)
    a = tmp_path / "pp2_then_pp1"
    first = pretrain(a, corpus_args, "train.max_steps=2", "parallel.pp=2", "parallel.stage_layers=[3,5]", *one,
                     *EVAL, procs=2)
    assert "pipeline: 1f1b, pp=2 x 1 stage(s) per rank, layers per stage [3, 5], 4 micro-batches" in first.stdout
    second = pretrain(a, corpus_args, "train.max_steps=4", *one, *EVAL)
    assert f"resumed from {a}/checkpoints/step_00000002 at step 2" in second.stdout
    b = tmp_path / "pp1_then_dualpipev"
    pretrain(b, corpus_args, "train.max_steps=2", *one)
    third = pretrain(b, corpus_args, "train.max_steps=4", "parallel.pp=2", "parallel.pipeline_schedule=dualpipev",
                     "train.recompute=full", *one, *EVAL, procs=2)
    assert f"resumed from {b}/checkpoints/step_00000002 at step 2" in third.stdout
    for run in (a, b):
        assert_records_match(ref, records(run))
    assert_evals_match(straight, a, [2, 4])  # pp=2 (1F1B) at step 2, pp=1 at 4
    assert_evals_match(straight, b, [4])  # pp=2 (DualPipeV) at step 4
    # the README's evaluate command on the pp=2 run's checkpoint: one process, whatever layout it was trained in
    # (issue 47 item 3), and the log says what it scored (item 6)
    ckpt = b / "checkpoints" / "step_00000004"
    out = warm_launch.run([sys.executable, str(ROOT / "launch" / "evaluate.py"), str(ckpt), "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_evals_match_one([e for e in evals(straight) if e["step"] == 4][0], json.loads(out.stdout.splitlines()[-1]))
    assert f"evaluating {ckpt}: 1 process(es) on cpu, pp=1 dp=1 ep=1 cp=1" in out.stderr
    assert re.search(r"\nheld-out set: \d+ micro-batches, text \d+ tokens", out.stderr), out.stderr
    assert f"eval of {ckpt} (step 4): loss " in out.stderr and "held-out evaluation every" not in out.stderr
    assert_clipped(ref)
    for run in (a, b):
        mb, _ = final_model(run, 4)
        assert_params_close(mb, straight, ref, 4)
        assert all(torch.equal(mb[k], ma[k]) for k in ma if k.endswith(("ffn.gate.bias", "ffn.gate.bias_vl")))


@pytest.mark.slow
@pytest.mark.xdist_group("trainer_one_sequence_reference")
def test_evaluate_a_checkpoint_in_another_layout_gives_the_runs_eval_record(tmp_path, one_sequence_reference):
    """launch/evaluate.py on the reference's step-2 checkpoint, under torchrun at pp=2 (its config from the
    checkpoint, the layout overridden): the run's own eval record of step 2."""
    straight, _ = one_sequence_reference
    out = warm_launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            str(ROOT / "launch" / "evaluate.py"), f"{straight}/checkpoints/step_00000002", "--json",
                            "parallel.pp=2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["step"] == 2 and "2 process(es) on cpu, pp=2 dp=1 ep=1 cp=1" in out.stderr
    assert_evals_match_one(evals(straight)[0], got)


LOCAL_TASK = """task: flashtrain_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
LOCAL_DOCS = [{"question": "def f(x):\n    return", "choices": [" x * 2", " ünïcode ✓ !!", " )))((("], "answer": 0},
              {"question": "import os\nimport", "choices": [" sys", " 7 7 7 7", " ]]"], "answer": 0},
              {"question": "for i in range(10):\n   ", "choices": [" @@@@", " print(i)", " ^^^^ ^^^^"], "answer": 1},
              {"question": "class A:\n    def", "choices": [" __init__(self):", " 0.0.0.0", " }}}"], "answer": 0}]


@pytest.mark.slow
@pytest.mark.xdist_group("trainer_one_sequence_reference")
def test_lm_eval_adapter_scores_literally_and_runs_a_local_task(tmp_path, one_sequence_reference):
    """The lm-evaluation-harness model `flashtrain` (train/evaluation/harness.py) on the reference's step-4 checkpoint:
    `loglikelihood` of hand-made requests (batched, so the shorter row is padded) equals the sum of the
    continuation's log-probabilities taken literally from the model's logits of the unpadded row; then
    `launch/harness.py` (the harness's command line) runs a local multiple-choice task end to end
    offline, and its accuracy is the one the literal log-probabilities give."""
    from lm_eval.api.instance import Instance
    from tokenizers import Tokenizer

    from flashtrain.model.aux import StepStats
    from flashtrain.train.evaluation.harness import FlashtrainLM

    straight, _ = one_sequence_reference
    ckpt = f"{straight}/checkpoints/step_00000004"
    lm = FlashtrainLM(checkpoint=ckpt, batch_size=2)
    tok = Tokenizer.from_file(lm.run.tokenizer)

    def literal(context, continuation):
        ctx = [0] + tok.encode(context, add_special_tokens=False).ids  # [BOS] + context
        cont = tok.encode(continuation, add_special_tokens=False).ids
        row = torch.tensor([ctx + cont])
        with torch.no_grad():
            hidden = lm.model.final_hidden(lm.model.run(row[:, :-1], torch.full_like(row[:, :-1], -1), [[]],
                                                        StepStats()))
            logp = torch.log_softmax(lm.model.head(hidden).double(), -1)[0]
        return sum(logp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont))

    pairs = [("def f(x):\n    return", " x * 2"), ("import os\nimport sys\nfrom pathlib import", " Path")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    # fp32 logits: the padded batch's GEMMs may round otherwise than the single row's (4.0e-8 of 37.4 on an AMD
    # EPYC, bit-equal on the CI machine before); a padding leak or an off-by-one position moves it by > 1e-3
    assert [g[0] for g in got] == pytest.approx([literal(*pair) for pair in pairs], rel=1e-9, abs=1e-6)
    assert all(g[0] < 0 for g in got)

    data = tmp_path / "local.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in LOCAL_DOCS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "local.yaml").write_text(LOCAL_TASK.format(data=data))
    out = warm_launch.run([sys.executable, str(ROOT / "launch" / "harness.py"), "--model", "flashtrain",
                            "--model_args", f"checkpoint={ckpt}", "--tasks", "flashtrain_local",
                            "--include_path", str(tmp_path / "tasks"), "--output_path", str(tmp_path / "results")],
                           cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(next((tmp_path / "results").rglob("results_*.json")).read_text())
    acc = result["results"]["flashtrain_local"]["acc,none"]
    picks = [max(range(len(d["choices"])), key=lambda c: literal(d["question"], d["choices"][c])) for d in LOCAL_DOCS]
    assert acc == pytest.approx(sum(p == d["answer"] for p, d in zip(picks, LOCAL_DOCS)) / len(LOCAL_DOCS))


def test_bad_pipeline_and_context_layouts_are_refused_before_anything_is_built():
    """The layout checks the trainer makes before its process group exists (`Trainer.__init__` -> train/build.py
    `run_plan`), on the composed config of a launch, in process: tests/test_launch.py shows such an error
    reaching the user as one line, exit 2, once under torchrun (a launch per layout here cost ~40 s of the
    suite)."""
    import re

    from flashtrain.config.errors import ConfigError
    from flashtrain.train.build import read_configs, run_plan
    from flashtrain.train.config import compose

    def plan(world, *overrides):
        return run_plan(read_configs(compose(["+exp=flash_tiny", *EIGHT_LAYERS, *overrides])), world)

    assert plan(2, "parallel.pp=2").dims.pp == 2  # the same config with a layout that fits
    with pytest.raises(ConfigError, match="parallel.pp=3 does not divide the world size 2"):
        plan(2, "parallel.pp=3")
    with pytest.raises(ConfigError, match=re.escape("parallel.stage_layers=[4, 4]: needs 4 positive layer counts")):
        plan(2, "parallel.pp=2", "parallel.pipeline_schedule=zbv", "parallel.stage_layers=[4,4]")
    with pytest.raises(ConfigError, match="parallel.cp=3 does not divide the 1 ranks"):
        plan(1, "parallel.cp=3", "train.max_steps=1")
    # a split backward (the V-shaped schedules) with selective recomputation, which torch raises on in the first
    # weight pass (tests/test_pipeline.py); full recomputation, or selective with a one-pass schedule, is a layout
    one = ["data.batch_size=1"]  # 4 micro-batches: as many as the 4 stages need
    for schedule in ("zbv", "dualpipev"):
        with pytest.raises(ConfigError, match=f"^train.recompute=selective with parallel.pipeline_schedule={schedule}: "
                                              f".*use train.recompute=none or full"):
            plan(2, "parallel.pp=2", f"parallel.pipeline_schedule={schedule}", "train.recompute=selective", *one)
        assert plan(2, "parallel.pp=2", f"parallel.pipeline_schedule={schedule}", "train.recompute=full",
                    *one).dims.pp == 2
    assert plan(2, "parallel.pp=2", "parallel.pipeline_schedule=interleaved_1f1b", "train.recompute=selective", *one)
    assert plan(1, "parallel.pipeline_schedule=dualpipev", "train.recompute=selective").dims.pp == 1  # no pipeline


@pytest.mark.slow
def test_data_parallel_with_expert_replicas_and_pipeline_with_experts_four_processes(tmp_path, corpus_args,
                                                                                   four_reader_reference):
    """4 processes, two layouts, against one process reading the same global batch (4 loader workers):
    - dp=4, ep=2: each expert shard lives on 2 of the 4 data-parallel ranks, so expert gradients are
      averaged over the shard's replicas (the dp > ep branch) while the rest is averaged over all 4;
      ZeRO-1 over 4 ranks, and both Engram tables row-sharded over the 4 (all-to-all lookups);
    - pp=2 x dp=2 with ep=2 (experts sharded over each stage's 2 dp ranks, 2 loader workers per rank),
      with train.recompute=selective (kept all-to-all outputs replayed inside pipeline stages) and the
      Engram tables row-sharded over each stage's 2 dp ranks (lookups requested before the blocks run).
    The same losses, grad norms and expert loads; for dp=4 x ep=2 also the MoE biases (exact) and the
    parameters after 2 steps."""
    ref_run, ref = four_reader_reference
    runs = {"dp4_ep2": ["parallel.ep=2", "data.num_workers=1", "parallel.engram_shard=true"],
            "pp2_dp2_ep2": ["parallel.pp=2", "parallel.ep=2", "data.num_workers=2", "train.recompute=selective",
                            "parallel.engram_shard=true"]}
    for name, layout in runs.items():
        out = pretrain(tmp_path / name, corpus_args, "data.batch_size=1", "train.max_steps=2", *layout, procs=4)
        if name.startswith("pp2"):
            assert "2 micro-batches per round" in out.stdout
        got = records(tmp_path / name)
        assert_clipped(got)
        for x, y in zip(ref[:2], got, strict=True):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-6)
            assert_grad_norms_close(x, y)
            assert y["expert_load"] == x["expert_load"]
    mb, _ = final_model(tmp_path / "dp4_ep2", 2)
    ma, _ = final_model(ref_run, 2)
    assert mb["layers.5.ffn.experts.w1"].shape[0] == 8
    assert all(torch.equal(mb[k], ma[k]) for k in ma if k.endswith(("ffn.gate.bias", "ffn.gate.bias_vl")))
    assert_params_close(mb, ref_run, ref, 2)


@pytest.mark.slow
def test_expert_parallel_trains_like_one_process_and_resumes_across_ep(tmp_path, corpus_args, four_reader_reference):
    """dp=2 x ep=2 on 2 processes (4 of 8 experts per rank, all-to-all dispatch, ZeRO-1, Engram tables
    row-sharded, 2 loader workers each) for steps 1-2, then pp=2 x dp=2 with ep=1 and replicated Engram
    tables on 4 processes for step 3, then the first layout again for step 4, against one process
    reading the same global batch (4 loader workers): the same losses, grad norms, expert loads and
    MoE biases, and parameters within rounding of the reference; the checkpoints hold global tensors
    (experts [8, ...], whole Engram tables, optimizer state) that reshard between the layouts."""
    run = tmp_path / "ep"
    sharded = ["parallel.ep=2", "parallel.engram_shard=true"]
    for steps, layout, procs in ((2, sharded, 2), (3, ["parallel.pp=2", "parallel.engram_shard=false"], 4),
                                 (4, sharded, 2)):
        out = pretrain(run, corpus_args, f"train.max_steps={steps}", *layout, "data.num_workers=2",
                       "data.batch_size=1", *EVAL, procs=procs)
        if steps > 2:
            assert f"resumed from {run}/checkpoints/step_{steps - 1:08d} at step {steps - 1}" in out.stdout
    ref_run, ref = four_reader_reference
    ma, oa = final_model(ref_run, 4)
    for x, y in zip(ref, records(run), strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6)
        assert_grad_norms_close(x, y)
        assert y["expert_load"] == x["expert_load"]
    assert_evals_match(ref_run, run, [2, 4])  # dp=2 x ep=2 at steps 2 and 4
    mb, ob = final_model(run, 4)
    assert mb["layers.5.ffn.experts.w1"].shape[0] == 8 and ob.keys() == oa.keys()
    assert all(torch.equal(mb[k], ma[k]) for k in ma if k.endswith(("ffn.gate.bias", "ffn.gate.bias_vl")))
    assert_params_close(mb, ref_run, ref, 4)


@pytest.mark.slow
@pytest.mark.xdist_group("trainer_one_sequence_reference")
def test_context_parallel_trains_like_one_process_and_resumes_across_cp(tmp_path, corpus_args,
                                                                        one_sequence_reference):
    """flash_tiny with images, cp=2 (with ep=2 folded over the cp ranks and selective recomputation),
    against the one-process reference (parallel.cp, model/sequence_split.py): steps 1-2 from the start,
    and steps 3-4 resumed at cp=2 from the reference's cp=1 checkpoint of step 2. The same losses, aux
    values, grad norms and expert loads at every step, parameters within rounding of the reference after
    steps 2 and 4 (read from the cp=2 checkpoints, which hold the one-process layout) and the MoE biases
    equal. Each cp=2 segment starts from the reference's own state: run on after cp=2 steps instead, the
    rounding-level difference of the parameters flips an indexer top-k near-tie within a step or two
    (the indexer loss moves by ~5e-4), which the record comparison, made for summation-order
    differences, rightly does not allow."""
    straight, ref = one_sequence_reference
    cp = ["parallel.cp=2", "parallel.ep=2", "train.recompute=selective", "data.batch_size=1"]
    first = tmp_path / "cp2_from_the_start"
    out = pretrain(first, corpus_args, "train.max_steps=2", *cp, *EVAL, procs=2)
    assert "2 process(es) on cpu, pp=1 dp=1 ep=2 cp=2, 2 steps" in out.stdout
    later = tmp_path / "cp2_from_a_cp1_checkpoint"
    out = pretrain(later, corpus_args, "train.max_steps=4",
                   f"train.resume_from={straight}/checkpoints/step_00000002", *cp, *EVAL, procs=2)
    assert f"resumed from {straight}/checkpoints/step_00000002 at step 2" in out.stdout
    got = records(first) + records(later)
    assert_records_match(ref, got)
    assert_evals_match(straight, first, [2])  # cp=2 x ep=2
    assert_evals_match(straight, later, [4])
    assert [y["skipped_samples"] for y in got] == [x["skipped_samples"] for x in ref]
    assert_clipped(ref)
    for run, step in ((first, 2), (later, 4)):
        mb, _ = final_model(run, step)
        ma, _ = final_model(straight, step)
        assert_params_close(mb, straight, ref, step)
        assert all(torch.equal(mb[k], ma[k]) for k in ma if k.endswith(("ffn.gate.bias", "ffn.gate.bias_vl")))
