"""Planning a run on hardware you don't have (the chip table is `muajax.chips`, model FLOPs
`muajax.models.flops`, the trainer's own measurements `muajax.train.step_metrics`).

topology     TPU slice names -> libtpu's ahead-of-time devices; fake CPU devices
compile      lower + compile a program from abstract sharded args; memory and costs
hlo,         collectives by kind and loop trip counts from the compiled HLO; FLOPs and
hlo_cost       bytes with every loop iteration counted
kernel_cost  the Pallas kernels' (custom calls') FLOPs and bytes, from their own formulas
roofline     an estimated time per program from its costs and the chip
programs     the GRPO/SFT steps and the engine's programs, built as the trainer builds them
phases       rollout and update: what is resident, part by part
planner      plan_run(): compile a run's programs and sum its phases -> Plan
sweep        meshes x remat policies, ranked by estimated step time
report       text tables

`python -m muajax.plan` is the command over it.
"""
