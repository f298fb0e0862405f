"""A small checkout in ACEBench's layout, written here (no ACEBench code or data): two
multi-turn items and one multi-step item over fixture sandbox classes (a phone with Wi-Fi
and a note book), their answers, and the constants muajax reads (class mapping, saved
attributes, agent and user prompts). The modules muajax must not run import a module that
does not exist, so a test fails if they are ever executed."""
from __future__ import annotations

import json
from pathlib import Path

BASE = '''
class BaseApi:
    def __init__(self):
        self.wifi = False
        self.logged_in = True

    def _load_scenario(self, scenario, long_context=False):
        self.wifi = scenario.get("wifi", False)
        self.logged_in = scenario.get("logged_in", True)

    def turn_on_wifi(self):
        self.wifi = True
        return {"status": True, "message": "Wi-Fi is on"}
'''

NOTES = '''
from model_inference.{subset}.scenariosen.base import BaseApi


class NoteApi(BaseApi):
    def __init__(self):
        super().__init__()
        self.notes = {{1: {{"text": "old note"}}}}
        self.counter = 1

    def add_note(self, text: str):
        if not self.wifi:
            return {{"status": False, "message": "Wi-Fi is off"}}
        self.counter += 1
        self.notes[self.counter] = {{"text": text}}
        return {{"status": True, "note_id": self.counter}}

    def delete_note(self, note_id: int):
        del self.notes[note_id]
        return "deleted"
'''

NEVER_RUN = "import muajax_fixture_module_that_does_not_exist  # muajax reads this file's constants only\n"

FUNCTIONS = {
    "turn_on_wifi": {"name": "turn_on_wifi", "description": "Turn on Wi-Fi.",
                     "parameters": {"type": "dict", "required": [], "properties": {}}},
    "add_note": {"name": "add_note", "description": "Add a note.",
                 "parameters": {"type": "dict", "required": ["text"],
                                "properties": {"text": {"type": "string", "description": "The note."}}}},
    "delete_note": {"name": "delete_note", "description": "Delete a note by id.",
                    "parameters": {"type": "dict", "required": ["note_id"],
                                   "properties": {"note_id": {"type": "integer", "description": "Its id."}}}},
}
ALL = [FUNCTIONS[n] for n in ("turn_on_wifi", "add_note", "delete_note")]
WIFI_ON = {"BaseApi": {"wifi": True, "logged_in": True}}

MULTI_TURN = [
    ({"id": "agent_multi_turn_0", "question": "You are Ann. You want a note that says 'buy milk'.",
      "initial_config": {"BaseApi": {"wifi": False}}, "path": [], "function": ALL,
      "involved_classes": ["BaseApi", "NoteApi"]},
     {"id": "agent_multi_turn_0", "ground_truth": [WIFI_ON, {"NoteApi": {"notes": {
         "1": {"text": "old note"}, "2": {"text": "buy milk"}}}}],
      "mile_stone": ["[turn_on_wifi()]", "[add_note(text='buy milk')]"]}),
    ({"id": "agent_multi_turn_1", "question": "You are Bo. You want the Wi-Fi on.",
      "initial_config": {"BaseApi": {"wifi": False}}, "path": [], "function": [FUNCTIONS["turn_on_wifi"]],
      "involved_classes": ["BaseApi"]},
     {"id": "agent_multi_turn_1", "ground_truth": [WIFI_ON], "mile_stone": ["[turn_on_wifi()]"]}),
]
MULTI_STEP = [
    ({"id": "agent_multi_step_0", "question": "Turn on the Wi-Fi, add the note \"Ann's list\" and delete note 1.",
      "initial_config": {"BaseApi": {"wifi": False}}, "path": [], "function": ALL,
      "involved_classes": ["BaseApi", "NoteApi"]},
     {"id": "agent_multi_step_0", "ground_truth": [WIFI_ON, {"NoteApi": {"notes": {"2": {"text": "Ann's list"}}}}],
      # two orders are right; the apostrophe inside single quotes is not Python as written (as in ACEBench's data)
      "mile_stone": [["[turn_on_wifi()]", "[add_note(text='Ann's list')]", "[delete_note(note_id=1)]"],
                     ["[turn_on_wifi()]", "[delete_note(note_id=1)]", "[add_note(text='Ann's list')]"]]}),
]

BASE_RULES = "Fixture phone rules: do what the user asks, one call at a time."
USER_TEMPLATE = "Fixture user.\nInstruction: {instruction}\nWhen it is done, write 'finish conversation'."


def _lines(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def write_checkout(root: Path, *, classes: dict[str, str] | None = None) -> Path:
    """The fixture checkout under `root`; `classes` adds to (or replaces) the class mapping."""
    files: dict[str, str] = {}
    for subset, items in (("multi_turn", MULTI_TURN), ("multi_step", MULTI_STEP)):
        files[f"data_all/data_en/data_agent_{subset}.json"] = _lines(q for q, _ in items)
        files[f"data_all/data_en/possible_answer/data_agent_{subset}.json"] = _lines(a for _, a in items)
        package = f"model_inference.{subset}.scenariosen"
        mapping = {"BaseApi": f"{package}.base", "NoteApi": f"{package}.notes", **(classes or {})}
        files[f"model_inference/{subset}/{subset}_utils.py"] = (
            f"{NEVER_RUN}CLASS_FILE_PATH_MAPPING_ZH = {{}}\nCLASS_FILE_PATH_MAPPING_EN = {mapping!r}\n")
        files[f"model_inference/{subset}/scenariosen/base.py"] = BASE
        files[f"model_inference/{subset}/scenariosen/notes.py"] = NOTES.format(subset=subset)
    files["model_inference/multi_turn/__init__.py"] = ""
    files["model_inference/apimodel_inference.py"] = (
        f"{NEVER_RUN}SAVED_CLASS = {{'BaseApi': ['wifi', 'logged_in'], 'NoteApi': ['notes']}}\n")
    files["model_inference/prompt_en.py"] = (
        f"{NEVER_RUN}BASE_PROMPT_EN = {BASE_RULES + chr(10) + chr(10) + 'Function Calls:' + chr(10) + 'Write [f()].'!r}\n"
        "TRAVEL_PROMPT_EN = 'Fixture airline rules.\\n\\nFunction Calls:\\nWrite [f()].'\n")
    files["model_inference/multi_turn/APIModel_user.py"] = (
        f"{NEVER_RUN}SYSTEM_PROMPT_BASE_EN = {USER_TEMPLATE!r}\nSYSTEM_PROMPT_TRAVEL_EN = 'Travel user: {{instruction}}'\n")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return root
