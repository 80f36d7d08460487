"""The torch-free core that the edge, the server and the single-device engine share.

Numpy only: draft trees (`tree`), tree drafting over any draft step (`drafting`), the cost model that chooses a
tree budget (`budget`), the wire protocol (`protocol`), the prompt and stop rules of a generation loop
(`generation`) and where things are cached (`paths`). Nothing here imports torch or transformers (a test enforces
it), so `edge_client` can ship it to a device that has neither.
"""
