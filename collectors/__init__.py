"""The node collector: kernel-log parsing and sources, NVML sampling, process lists, workloads,
and the Kafka sink with its on-disk spool. Never imports faust (see tests/schemas/test_import_hygiene.py)."""
