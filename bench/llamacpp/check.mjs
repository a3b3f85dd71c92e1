// llama.cpp's side of bench/llamacpp_check.py: node-llama-cpp (its prebuilt llama.cpp, CPU) loads
// a GGUF file and answers one JSON request: tokenizations, chat templates rendered by llama.cpp's
// own Jinja engine, a greedy continuation, and each scored sequence's per-token log-probabilities.
//
//     node check.mjs REQUEST.json RESULT.json
//
// The request: {model, threads, context_size, tokenize: [text], chat: [[{role, content}]],
// greedy: {prompt: [id], max_new_tokens, stops: [id]}, score: [[id]]}. Only what is asked is done.
import fs from "node:fs";
import {getLlama, LlamaLogLevel} from "node-llama-cpp";

const [requestPath, resultPath] = process.argv.slice(2);
const request = JSON.parse(fs.readFileSync(requestPath, "utf8"));
// Scored positions per call: each returns a probability for every token of the vocabulary, so a
// sequence is fed in slices to keep a few of those 262,144-entry maps alive at a time.
const SCORE_SLICE = 8;

const llama = await getLlama({gpu: false, logLevel: LlamaLogLevel.error, build: "never"});
const started = performance.now();
const model = await llama.loadModel({modelPath: request.model});
const result = {
    llama_cpp: llama.llamaCppRelease,
    load_seconds: (performance.now() - started) / 1000,
    metadata: model.fileInfo.metadata.general,
    vocab_size: model.fileInfo.metadata.tokenizer?.ggml?.tokens?.length,
    vocabulary_type: model.vocabularyType,  // llama.cpp's tokenizer for the file: "spm"
    bos: model.tokens.bos,
    eos: model.tokens.eos,
    eot: model.tokens.eot,
    architecture: model.fileInfo.metadata.general.architecture,
    train_context_size: model.trainContextSize,
};

if (request.tokenize)
    result.tokenize = request.tokenize.map((text) => Array.from(model.tokenize(text, false)));

if (request.chat) {
    // The template the file carries, rendered by llama.cpp's Jinja engine (common/jinja, as
    // llama-server and llama-cli run it), then tokenized with special pieces parsed.
    const template = model.fileInfo.metadata.tokenizer?.chat_template;
    result.chat_template_present = template != null;
    if (template != null) {
        const renderer = new llama._bindings.AddonJinjaRenderer(template);
        result.chat = request.chat.map((messages) => {
            const text = renderer.render({
                messages, add_generation_prompt: true, bos_token: "<bos>", eos_token: "<eos>",
            });
            return {text, tokens: Array.from(model.tokenize(text, true))};
        });
    }
}

const context = await model.createContext({
    contextSize: request.context_size ?? 1024, threads: request.threads ?? 2,
    sequences: 1, batchSize: 512,
});
const sequence = context.getSequence();
const greedy = {temperature: 0};

if (request.greedy) {
    const {prompt, max_new_tokens: maxNew, stops} = request.greedy;
    const generated = [];
    const t0 = performance.now();
    let input = prompt.map((token, i) => i === prompt.length - 1
        ? [token, {generateNext: {token: true, options: greedy}}] : token);
    for (let step = 0; step < maxNew; step++) {
        const outputs = await sequence.controlledEvaluate(input);
        const next = outputs[input.length - 1].next.token;
        generated.push(next);
        if (stops.includes(next))
            break;
        input = [[next, {generateNext: {token: true, options: greedy}}]];
    }
    result.greedy = {tokens: generated, seconds: (performance.now() - t0) / 1000};
    await sequence.clearHistory();
}

if (request.score) {
    const t0 = performance.now();
    result.score = [];
    for (const tokens of request.score) {
        const logprobs = [];
        for (let start = 0; start < tokens.length - 1; start += SCORE_SLICE) {
            const stop = Math.min(start + SCORE_SLICE, tokens.length - 1);
            const input = tokens.slice(start, stop).map(
                (token) => [token, {generateNext: {probabilities: true, options: greedy}}]);
            const outputs = await sequence.controlledEvaluate(input);
            for (let i = start; i < stop; i++) {
                const probability = outputs[i - start].next.probabilities.get(tokens[i + 1]) ?? 0;
                logprobs.push(Math.log(probability));
            }
        }
        result.score.push(logprobs);
        await sequence.clearHistory();
    }
    result.score_seconds = (performance.now() - t0) / 1000;
}

await context.dispose();
await model.dispose();
fs.writeFileSync(resultPath, JSON.stringify(result));
