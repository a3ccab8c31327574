"""Training and evaluating the real pair's helpers: the distilled draft (`python -m
real.train.draft`, `real.train.eval_draft`) and DISCO's stopping classifier (`real.train.disco`)."""
