"""Model implementations: shared layers (norm, rotary, fused linears, MLP, attention block, decoder)
and one module per architecture. Import architectures from their modules, e.g.
`from graphrunner.models.qwen3 import Qwen3ForCausalLM`; model_states/ picks the class per HF name.
"""
