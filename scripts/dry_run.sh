# The --dry-run mode of the tpu/ and gpu/ scripts (sourced by them, not run).
#
# Sourced by a script, this takes --dry-run out of the script's arguments (anywhere among
# them) and sets DRY_RUN=1. The script runs every outside command (gcloud, ssh, scp, srun,
# curl, tar, pip, python ...) through `run`, `run_with_input` or, for a command whose output
# it reads, `ask`: with --dry-run these print the command instead of running it, and the
# script ends with exit 0. Each printed command is one `+ ` line of shell words that reads
# back as the same arguments (a word that needs quoting is single-quoted, over several lines
# if it holds newlines, as a remote script does), so tests/scripts/test_scripts.py can parse
# them and run the Python they contain.
DRY_RUN=
_dry_run_args=()
for _dry_run_arg in "$@"; do
  if [[ "$_dry_run_arg" == --dry-run ]]; then DRY_RUN=1; else _dry_run_args+=("$_dry_run_arg"); fi
done
set -- ${_dry_run_args[@]+"${_dry_run_args[@]}"}
unset _dry_run_arg _dry_run_args
exec {DRY_RUN_FD}>&1  # the script's standard output, which `ask` prints to from inside $(...)

# A command as shell words: `+ word ...`.
command_line() {
  local line="+" word quote="'\\''"
  for word in "$@"; do
    if [[ "$(printf %q "$word")" == "$word" ]]; then line+=" $word"; else line+=" '${word//\'/$quote}'"; fi
  done
  printf '%s' "$line"
}

# One write per command (env printf: the external one, fully buffered; bash's own writes a
# multi-line word line by line), so that commands a script starts in the background at
# once do not interleave.
show_command() {
  env printf '%s\n' "$(command_line "$@")" >&"$DRY_RUN_FD"
}

# Run a command, or with --dry-run print it.
run() {
  if [[ -n "$DRY_RUN" ]]; then show_command "$@"; else "$@"; fi
}

# run_with_input TEXT COMMAND...: the command with TEXT on its standard input; with
# --dry-run printed as `+ COMMAND... <<< 'TEXT'`.
run_with_input() {
  local text=$1 quote="'\\''"
  shift
  if [[ -n "$DRY_RUN" ]]; then
    env printf '%s\n' "$(command_line "$@") <<< '${text//\'/$quote}'" >&"$DRY_RUN_FD"
  else
    printf '%s' "$text" | "$@"
  fi
}

# ask STANDIN COMMAND...: the command's output; with --dry-run the command is printed and
# STANDIN stands for its output.
ask() {
  local standin=$1
  shift
  if [[ -n "$DRY_RUN" ]]; then show_command "$@"; printf '%s\n' "$standin"; else "$@"; fi
}
