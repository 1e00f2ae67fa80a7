"""`ddpkit runs / status / logs / cancel`: the life of a run after its launch, whatever target started
it.
"""
