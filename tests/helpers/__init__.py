"""What the tests share (no test file imports another): process launchers (`multiproc`, `gloo_logprobs`) and the one
`free_port` (`ports`), tiny Hugging Face models (`hf_tiny`), the stage tests' assets, argv and runs (`stage_assets`,
`word_task`, `stage_layouts`, `model_state_runs`), reference computations (`hf_parity`, `trl_reference`,
`convert_checks`, `threads`, `routing_batches`), MindSpeed-RL run configs (`mindspeed_rl_configs`), the data tests'
fixtures (`fixtures_data`), the virtual-device guard (`device_guard`) and scripts imported by path (`scripts`).
Map: tests/README.md."""
