"""Token oracles of the simulator: where its draft and target token distributions come from
(`acceptance=iid|synthetic|trace`)."""
