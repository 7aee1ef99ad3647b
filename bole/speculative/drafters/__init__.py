"""Drafters behind one interface (base.py) and a registry (registry.py): n-gram lookup and a
separate draft model on the host (ngram.py, draft_model.py, their trees grown by
host_growth.py), the checkpoint's MTP head and the benchmarks' replay on the device (mtp.py,
replay.py; draft_vocab.py restricts a head's proposals)."""
