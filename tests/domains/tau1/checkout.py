"""A small tau-bench checkout written here, in τ1's format (Python files of Task(...) calls),
over records of τ2's retail database: nothing of τ1 is copied."""
from __future__ import annotations

import os

HEADER = "from tau_bench.types import Task, Action\n\n"

# Fatima Anderson's pending order #W2974929 (one skateboard, paid with paypal_7916550) in τ2's retail DB
CANCEL = '''    Task(
        annotator="fixture",
        user_id="fatima_anderson_2157",
        instruction="Your name is Fatima Anderson and your zip code is 32100. Cancel order #W2974929 because no longer needed.",
        actions=[
            Action(name="find_user_id_by_name_zip", kwargs={"first_name": "Fatima", "last_name": "Anderson", "zip": "32100"}),
            Action(name="cancel_pending_order", kwargs={"order_id": "#W2974929", "reason": "no longer needed"}),
        ],
        outputs=["182.03"],
    ),
'''
# Ava Moore's delivered order #W4817420: return its water bottle to the gift card it was paid with
RETURN = '''    Task(
        user_id="ava_moore_2033",
        instruction="You are Ava Moore. Return the water bottle of #W4817420 to your gift card.",
        actions=[
            Action(
                name="return_delivered_order_items",
                kwargs={"order_id": "#W4817420", "item_ids": ["6777246137"], "payment_method_id": "gift_card_8168843"},
            )
        ],
        outputs=[],
    ),
'''
# an order τ2's database does not hold: the gold action fails there
MISSING_ORDER = '''    Task(
        user_id="nobody_0000",
        instruction="Cancel order #W0000000.",
        actions=[Action(name="cancel_pending_order", kwargs={"order_id": "#W0000000", "reason": "ordered by mistake"})],
        outputs=[],
    ),
'''
# a tool τ2's retail agent lacks, an argument cancel_pending_order does not take, and an
# item "modified" into itself (τ1's tool kept it, τ2's refuses the call)
UNMAPPED = '''    Task(
        user_id="fatima_anderson_2157",
        instruction="Refund everything.",
        actions=[
            Action(name="refund_everything", kwargs={}),
            Action(name="cancel_pending_order", kwargs={"order_id": "#W2974929", "reason": "no longer needed", "note": "x"}),
            Action(
                name="modify_pending_order_items",
                kwargs={"order_id": "#W2974929", "item_ids": ["3877188862"], "new_item_ids": ["3877188862"],
                        "payment_method_id": "paypal_7916550"},
            ),
        ],
        outputs=[],
    ),
'''


def task_file(name: str, *tasks: str) -> str:
    return HEADER + f"{name} = [\n" + "".join(tasks) + "]\n"


def write_checkout(root, train=(CANCEL, RETURN), dev=(MISSING_ORDER,), test=(UNMAPPED,), airline=()) -> str:
    """A checkout's layout under `root` with these retail train/dev/test tasks and airline test tasks."""
    files = {
        "tau_bench/envs/retail/tasks_train.py": task_file("TASKS_TRAIN", *train),
        "tau_bench/envs/retail/tasks_dev.py": task_file("TASKS_DEV", *dev),
        "tau_bench/envs/retail/tasks_test.py": task_file("TASKS_TEST", *test),
        "tau_bench/envs/airline/tasks_test.py": task_file("TASKS", *airline),
    }
    for relative, text in files.items():
        path = os.path.join(root, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return str(root)
