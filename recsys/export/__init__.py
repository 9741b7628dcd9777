"""The published lists in a key-value store: the value format (``encoding``, pure), Redis's key layout,
versions, pointer and lock (``redis_store``), the executors' writing job (``writer``) and a local Redis
server for the demo, tests and benchmarks (``local_redis``). docs/export.md is the reference."""
