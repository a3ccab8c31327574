"""The run table `python -m testbed` prints: a tree run shows its shape and tokens per
verification, not a γ it never used; a real run on this CPU counts cores."""

from __future__ import annotations

from pathlib import Path

from testbed.app.main import print_summary

BASE = {"backend": "sim", "schedule": "sync", "pair": "p", "hardware": "h800x8", "target_gpus": 8,
        "draft_gpus": 8, "gamma": 4, "tokens_per_s": 100.0, "tpot_ms": 10.0, "speedup": 2.0,
        "alpha": 0.8, "mean_accepted_len": 2.5, "prefill_s": 0.01}


def test_a_chain_shows_gamma_and_a_tree_its_shape(capsys) -> None:  # type: ignore[no-untyped-def]
    print_summary(BASE, Path("/run"))
    chain = capsys.readouterr().out
    assert "γ=4" in chain and "mean accepted len" in chain and "tokens per verification" not in chain
    print_summary({**BASE, "schedule": "async", "tree_shape": "w=8 bs=8 d=3"}, Path("/run"))
    tree = capsys.readouterr().out
    assert "γ=" not in tree and "w=8" in tree and "tokens/verification" in tree
    assert "w=8 bs=8 d=3: 2.500 tokens per verification" in tree


def test_a_real_run_on_this_cpu_counts_cores(capsys) -> None:  # type: ignore[no-untyped-def]
    print_summary({**BASE, "backend": "real", "hardware": "local", "target_gpus": 2, "draft_gpus": 2}, Path("/r"))
    out = capsys.readouterr().out
    assert "target 2 cores" in out and "GPU" not in out


def test_a_decentralized_run_shows_its_nodes_and_links(capsys) -> None:  # type: ignore[no-untyped-def]
    print_summary({**BASE, "schedule": "decentralized", "hardware": "a800_nodes", "nodes": 4,
                   "target_gpus": 1, "draft_gpus": 1, "latency_ms": 20.0}, Path("/r"))
    out = " ".join(capsys.readouterr().out.split())  # the title may wrap
    assert "4 nodes × target 1 GPU" in out and "20 ms links" in out
    print_summary({**BASE, "nodes": 1}, Path("/r"))
    assert "nodes" not in capsys.readouterr().out
