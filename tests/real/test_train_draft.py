"""The distilled SmolLM2 draft (issue 5): shipped checkpoint, export, resume, eval accounting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from real.train.draft import (
    draft_args,
    draft_logits,
    export_hf,
    init_draft,
    reference_kernels,
    train,
)
from real.train.eval_draft import sync_accepted_lengths
from testbed.paths import repo_path
from testbed.spec.sampling import SamplingParams, standardize
from testbed.spec.speculative import speculative_step

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "models" / "smollm2-draft"
TINY_ARCH = dict(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=96, vocab_size=49152,
                 max_seq_len=256)


@pytest.mark.model
def test_shipped_checkpoint_loads_with_target_vocab_and_fits_size_budget() -> None:
    from real.model.tokenizer import load_bundled_tokenizer
    from real.model.weights import load_model

    size = sum(f.stat().st_size for f in SHIPPED.iterdir() if f.is_file())
    assert size <= 30 * 2**20, f"{size / 2**20:.1f} MiB"
    config = json.loads((SHIPPED / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    draft, tok = load_model(SHIPPED, max_seq=64)
    target_tok = load_bundled_tokenizer()
    assert draft.args.vocab_size == target_tok.vocab_size == 49152
    text = "def f(x):\n    return x  # <|im_start|>user\nHi<|im_end|>"
    assert tok.encode(text) == target_tok.encode(text)
    assert tok.eos_token_ids == target_tok.eos_token_ids
    # a trained model, not noise: it continues an obvious pattern
    ids = target_tok.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,")
    with torch.inference_mode():
        logits = draft(torch.tensor([ids]), 0)[0, -1]
    assert torch.isfinite(logits).all()
    assert target_tok.decode([int(logits.argmax())]) == " "


@pytest.mark.model
def test_export_matches_training_module_in_our_loader_and_transformers(tmp_path: Path) -> None:
    from real.model.weights import load_model

    torch.manual_seed(0)
    model = init_draft(draft_args(TINY_ARCH), None, seed=3)
    export_hf(model, tmp_path, dtype=torch.float32)
    x = torch.tensor([[1, 504, 2300, 17, 9, 4000, 42, 7, 7, 7]])
    with torch.no_grad(), reference_kernels():  # the training forward: cache-free, reference ops
        ref = draft_logits(model, x)
    ours, _ = load_model(tmp_path, max_seq=32)
    with torch.inference_mode():
        got = ours(x, 0)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ref, atol=1e-4, rtol=1e-4)


def _tiny_cfg(tmp: Path, work: str, stop_after: int | None = None):
    cfg = OmegaConf.load(ROOT / "conf" / "train_draft.yaml")
    cfg.pop("hydra")
    cfg.work_dir, cfg.data_dir, cfg.out = str(tmp / work), str(tmp / "data"), str(tmp / work / "out")
    cfg.init_from_target = False
    cfg.arch = OmegaConf.merge(cfg.arch, TINY_ARCH)
    cfg.data = OmegaConf.merge(cfg.data, dict(max_prompts_per_workload=1, stdlib_functions=0,
                                              max_new_tokens=6, max_new_tokens_sampled=4,
                                              raw_tokens=0, gen_batch=3))
    cfg.steps, cfg.stop_after = 6, stop_after
    cfg.train = OmegaConf.merge(cfg.train, dict(batch_rows=2, seq_len=16, warmup=2))
    return cfg


def _fake_teacher_shards(cfg) -> None:
    """Random teacher data under the shard names of the tiny config's jobs, so the test needs
    no target forward (the data phase finds every shard and skips the teacher)."""
    from real.model.tokenizer import load_bundled_tokenizer
    from real.train.draft_data import data_jobs, shard_name

    gen, k = torch.Generator().manual_seed(0), cfg.data.topk
    data_dir = Path(cfg.data_dir)
    data_dir.mkdir(parents=True)
    for name, kind, payload in data_jobs(cfg, load_bundled_tokenizer()):
        seqs = []
        for n, n_prompt in ((40, 12), (25, 8), (33, 30)):
            lp = torch.log_softmax(torch.randn(n - 1, k, generator=gen), -1) - 0.2
            seqs.append({"tokens": torch.randint(0, 49152, (n,), generator=gen, dtype=torch.int32),
                         "idx": torch.randint(0, 49152, (n - 1, k), generator=gen, dtype=torch.int32),
                         "lp": lp.half(), "n_prompt": n_prompt, "kind": "gen"})
        torch.save(seqs, data_dir / shard_name(name, kind, payload, cfg))


@pytest.mark.model  # the data phase reads the bundled tokenizer to name its jobs
def test_resumed_training_reproduces_an_uninterrupted_run(tmp_path: Path) -> None:
    _fake_teacher_shards(_tiny_cfg(tmp_path, "straight"))
    straight = train(_tiny_cfg(tmp_path, "straight"))
    assert (tmp_path / "straight" / "out" / "model.safetensors").is_file()
    # interrupted after 2 steps (checkpointed), then the same command again: resumes at step 2
    half = train(_tiny_cfg(tmp_path, "resumed", stop_after=2))
    assert not (tmp_path / "resumed" / "out").exists()
    assert torch.load(tmp_path / "resumed" / "ckpt.pt", weights_only=False)["step"] == 2
    resumed = train(_tiny_cfg(tmp_path, "resumed"))
    moved = any(not torch.equal(a, b) for a, b in zip(half.state_dict().values(),
                                                       straight.state_dict().values()))
    assert moved  # 2 steps differ from 6: the comparison below can fail
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_repo_relative_paths_do_not_depend_on_cwd(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert repo_path("models/smollm2-draft") == SHIPPED
    assert repo_path(tmp_path) == tmp_path


# ---------------------------------------------------------------- T0 accepted-length accounting
def _toy_target(seq: list[int]) -> int:
    return (3 * sum(seq) + len(seq)) % 11


def _toy_draft(seq: list[int]) -> int:
    """Agrees with the target most of the time, in a prefix-dependent pattern."""
    t = _toy_target(seq)
    return t if (sum(i * x for i, x in enumerate(seq)) % 7) < 5 else (t + 1) % 11


def _one_hot(tokens: list[int], vocab: int = 11) -> torch.Tensor:
    logits = torch.full((len(tokens), vocab), -5.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return standardize(logits, SamplingParams(temperature=0.0))


def _brute_force_sync(prompt: list[int], n_tokens: int, gamma: int) -> tuple[list[int], list[int]]:
    """Real sync decoding at T0 with Algorithm 1: returns (generated tokens, accepted per round)."""
    seq, accepted, gen = list(prompt), [], torch.Generator().manual_seed(0)
    while len(seq) - len(prompt) < n_tokens:
        guesses: list[int] = []
        for _ in range(gamma):
            guesses.append(_toy_draft(seq + guesses))
        p = _one_hot([_toy_target(seq + guesses[:j]) for j in range(gamma + 1)])
        step = speculative_step(p, _one_hot(guesses), draft_tokens=torch.tensor(guesses), generator=gen)
        accepted.append(step.accepted)
        seq += step.tokens
    return seq[len(prompt):], accepted


@pytest.mark.parametrize("gamma", [1, 3, 4])
def test_t0_run_length_accounting_matches_brute_force_sync(gamma: int) -> None:
    prompt, m = [2, 5, 1], 200
    generated, brute = _brute_force_sync(prompt, m + 2 * gamma + 2, gamma)
    cont = generated[:m]
    # teacher forcing: each model's argmax after prompt + cont[:i]
    target_tf = torch.tensor([_toy_target(prompt + cont[:i]) for i in range(m)])
    draft_tf = torch.tensor([_toy_draft(prompt + cont[:i]) for i in range(m)])
    assert torch.equal(target_tf, torch.tensor(cont))  # lossless: sync emits the target's greedy text
    counted = sync_accepted_lengths(target_tf, draft_tf, gamma)
    assert 0 < (draft_tf == target_tf).float().mean() < 1  # both outcomes occur
    assert len(counted) > m // (gamma + 1)
    assert counted == brute[: len(counted)]


@pytest.mark.model
def test_teacher_generation_is_each_prompts_greedy_continuation_with_its_top_k() -> None:
    """generate_batch serves its prompts as continuous batching does (a cache row each, one
    batched forward a step): each greedy continuation equals the prompt's own `ar` continuation,
    rows that stop early stop alone, and the recorded top-k are the target's log-probabilities
    at every position (prompt and generated) but the last."""
    from real.model.generate import greedy_generate
    from real.model.weights import load_model
    from real.train.draft_data import generate_batch

    target, tok = load_model(max_seq=96)
    prompts = [tok.encode(t) for t in ("def add(a, b):", "The capital of France is", "x = [1, 2, 3]\nprint(")]
    eos = [tok.encode(" Paris")[0]]  # a stop token one of the prompts reaches early
    seqs = generate_batch(target, prompts, max_new=10, temperature=0.0, k=4, eos=eos, gen=torch.Generator())
    served_alone, _ = load_model(max_seq=96)
    for p, s in zip(prompts, seqs):
        alone = greedy_generate(served_alone, p, 10, eos_token_ids=eos)
        assert s["tokens"].tolist() == p + alone and s["n_prompt"] == len(p)
        full = served_alone(torch.tensor([s["tokens"].tolist()]), 0)[0, :-1]  # teacher-forced
        lp = torch.log_softmax(full.float(), -1)
        assert s["idx"].shape == (len(s["tokens"]) - 1, 4)
        assert torch.equal(s["idx"][:, 0].long(), lp.argmax(-1))
        assert torch.allclose(s["lp"].float(), lp.gather(-1, s["idx"].long()), atol=1e-2)  # kept in fp16
    assert len(seqs[1]["tokens"]) - len(prompts[1]) < 10 and seqs[1]["tokens"][-1] == eos[0]


@pytest.mark.model
def test_teacher_batches_in_two_workers_write_the_shards_one_worker_writes(tmp_path: Path) -> None:
    """build_teacher_data with two workers (two copies of the target in threads, batches taken
    as they free up) writes the very shards one worker does: greedy, sampled and teacher-forced
    batches, every token and top-k log-probability equal."""
    from real.train.draft_data import build_teacher_data

    shards = {}
    for workers in (1, 2):
        cfg = _tiny_cfg(tmp_path, f"w{workers}")
        cfg.data = OmegaConf.merge(cfg.data, dict(stdlib_functions=3, max_prompt_tokens=24, gen_batch=2,
                                                  raw_tokens=256, raw_chunk=32, raw_batch=3))
        paths = build_teacher_data(cfg, tmp_path / f"data{workers}", workers=workers)
        shards[workers] = {p.name: torch.load(p, weights_only=False) for p in paths}
    kinds = {name.split("_")[0] for name in shards[1]}
    assert kinds == {"greedy", "sampled", "raw"} and len(shards[1]) >= 6
    assert shards[2].keys() == shards[1].keys()
    for name, seqs in shards[1].items():
        assert len(shards[2][name]) == len(seqs)
        for a, b in zip(seqs, shards[2][name]):
            assert a.keys() == b.keys() and a["n_prompt"] == b["n_prompt"]
            for key in ("tokens", "idx", "lp"):
                assert torch.equal(a[key], b[key]), (name, key)
    sampled = next(s for n, s in shards[1].items() if n.startswith("sampled"))
    greedy = next(s for n, s in shards[1].items() if n.startswith("greedy"))
    assert any(not torch.equal(a["tokens"], b["tokens"]) for a, b in zip(sampled, greedy))  # T=1 sampled


def test_a_draft_vocabulary_ranks_the_target_s_own_tokens_first_then_the_corpus() -> None:
    from collections import Counter

    from real.train.draft_vocab import rank_tokens

    ranked = rank_tokens(Counter({5: 3, 2: 7}), Counter({9: 100, 5: 1, 1: 4}), 10)
    assert ranked[:4] == [2, 5, 9, 1]  # every generated token before any corpus one
    assert sorted(ranked) == list(range(10))  # every token once, the unseen by id
    assert ranked[4:] == [0, 3, 4, 6, 7, 8]


def test_a_draft_vocabulary_needs_an_eagle_head_s_folder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "real.train.draft_vocab", "--head", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not an eagle head's folder" in proc.stdout
    assert len(proc.stdout.strip().splitlines()) == 1


@pytest.mark.parametrize("override, names", [("eagle.unroll=0", "eagle.unroll=0"),
                                             ("eagle.init=no/such/head", "eagle.init=no/such/head")])
def test_bad_eagle_training_settings_are_refused_in_one_line_before_any_data(tmp_path, override,  # type: ignore[no-untyped-def]
                                                                             names) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "real.train.draft", "kind=eagle", override,
                           f"work_dir={tmp_path}/work", f"hydra.run.dir={tmp_path}/hydra"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0], lines
    assert not (tmp_path / "work").exists()  # refused before any teacher batch or feature is made
