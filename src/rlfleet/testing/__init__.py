"""The harness that tests, benchmarks and the demo share (no production code imports it):
local fleets and vLLM's own server (fleet), and throw-away servers on 127.0.0.1 free ports:
etcd (etcd), an S3 store (s3), a Ray head (ray), and a private network of Linux network
namespaces for multi-host runs (netns). Importing this package imports none of them."""
