"""loka.dispatch"""

from loka.dispatch.lora_plan import LoraPlan, plan_lora_jobs

__all__: list[str] = [
    # the LoRA job planner (PLoRA); its models live in loka.dispatch.lora_plan
    "LoraPlan",
    "plan_lora_jobs",
]
