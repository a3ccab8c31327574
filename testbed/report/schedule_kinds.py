"""Which runs a section is about, by their schedule's declaration (testbed.schedules), never by
its name: a summary's ``schedule`` is looked up in the table; a name the table does not know
(a run of a schedule this checkout lacks) counts as a drafting schedule of no particular kind."""

from __future__ import annotations

import pandas as pd

from testbed.schedules import names_where


def without_draft() -> tuple[str, ...]:
    """Schedules without a draft model: the `ar` baseline."""
    return names_where(lambda s: not s.drafts)


def drafting(df: pd.DataFrame) -> pd.Series:
    """Rows of runs that draft (everything but `ar`)."""
    return ~df["schedule"].isin(without_draft())


def chains() -> tuple[str, ...]:
    """Serial chain schedules (`sync`): Algorithm 1, Theorem 3.8, per-token lookahead."""
    return names_where(lambda s: s.chain)


def serial() -> tuple[str, ...]:
    """Draft and target taking turns on the same devices (`sync`, `sync_tree`)."""
    return names_where(lambda s: s.serial)


def pipelined() -> tuple[str, ...]:
    """Drafting pipelines over links (`decentralized`, DSD)."""
    return names_where(lambda s: s.pipelined)
