"""The worker process that `python -m rlfleet.vllm` and `python -m rlfleet.mocker` share:
serving (`serve`), the admin routes over the engine-control interface (`admin`, `engine`),
the worker's own admission hold (`admission`), the system server (`system_server`) and the
request plane's server side (`stream_server`)."""
