"""The run machinery: params, stage registry, runner, artifacts, launchers, processes, logs, DVC generation."""
