"""What the tests share (no test file imports another): gloo process launchers (`multiproc`, `gloo_logprobs`),
the one `free_port` (`ports`), tiny Hugging Face models (`hf_tiny`), the stage tests' assets and argv (`stage_assets`,
`word_task`, `model_state_runs`), the data tests' fixtures (`fixtures_data`) and the virtual-device guard
(`device_guard`). Map: tests/README.md."""
