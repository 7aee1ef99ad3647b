"""Linear-attention layer types: the interface (:mod:`.base`), one module per type (:mod:`.gdn`)
and the registry by config name (:mod:`.registry`)."""
