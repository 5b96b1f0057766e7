"""The stream processor: joins the input topics by GPU UUID, classifies, plans remediation.

`xidstream.streams.classify` and `xidstream.streams.fleet` are pure folds (no faust, no I/O); `xidstream.streams.app` wires them
into a faust-streaming app built by `create_app(settings, policy)`. Never imports NVML.
"""
