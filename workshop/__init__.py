"""The workshop: the local harnesses of a checkout (Kafka broker and cluster, kube-apiserver,
a real single-node cluster, the e2e driver, the demo's plumbing). Not part of the product: not in
the wheel, not in the images; `python -m workshop --help` lists its commands (workshop/cli.py).
"""
