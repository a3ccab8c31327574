"""Running a real experiment: loading the pair, the engine, the worker processes of
multi-process layouts, the links between them, telemetry and repeated runs."""
