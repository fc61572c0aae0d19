"""Adapters that put the FlashSpec engine under agent frameworks.

    from flashspec_integrations.langchain import ChatFlashSpec, FlashSpecLLM
    from flashspec_integrations.llama_index import FlashSpecLLM

One subpackage per framework (`langchain/`, `llama_index/`: one module per public class), each
imported on demand, so this package imports neither framework. Beside them, what both share:

- `settings`: the constructor fields (same names in both adapters) and the engine they resolve to;
- `engines`: one process-wide engine per engine setting;
- `domain_rules`: a call's framework context -> the router domain (also used by other front ends);
- `calls`: one engine call, run or streamed (concurrent calls join the engine's running batch);
- `prompts`, `tool_calls`: the Hermes tool prompt and chat rendering, and one tool-call parser;
- `async_bridge`: engine streams iterated from coroutines; `hashing`: an offline embedding.
"""
