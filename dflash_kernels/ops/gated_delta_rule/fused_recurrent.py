def fused_recurrent_gated_delta_rule(*a, **k): raise NotImplementedError
