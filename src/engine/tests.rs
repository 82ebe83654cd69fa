use super::batch::share_drafts;
use super::steps::step_rows;
use super::{Engine, EngineConfig, EngineError, EngineHealth, Event, Fault, Request};
use crate::Error;
use crate::{backends::NdArray, Checkpoint, GenerationConfig, LoadOptions, SamplingConfig, StopReason, Tokenizer};
use std::sync::atomic::Ordering;

/// The tiny Gemma 3 fixture's engine, and its tokenizer's vocabulary (512 tokens).
pub(crate) fn tiny_engine() -> Result<Engine, crate::Error> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-gemma/gemma3");
    let options = LoadOptions::<NdArray>::new().dtype(burn::tensor::DType::F32);
    let model = Checkpoint::open(&dir)?.load(options)?.model;
    // The integration tests' vocabulary: control tokens, the 256 byte tokens, then words.
    let mut tokens = vec!["<pad>".to_string(), "<eos>".into(), "<bos>".into(), "<unk>".into()];
    tokens.extend(["<start_of_turn>".to_string(), "<end_of_turn>".into()]);
    let mut types = vec![3; tokens.len()];
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    types.resize(tokens.len(), 6);
    tokens.extend((tokens.len()..512).map(|i| format!("w{i}")));
    types.resize(512, 1);
    let scores = (0..512).map(|i| -(i as f32)).collect();
    Engine::new(model, Tokenizer::from_vocab(tokens, scores, types, 2)?, EngineConfig::default())
}

fn request(tokens: usize) -> Request {
    let generation = GenerationConfig {
        max_new_tokens: tokens,
        sampling: SamplingConfig { temperature: 0.0, ..SamplingConfig::default() },
        ..GenerationConfig::default()
    };
    Request::new(vec![2, 40, 41, 42], generation)
}

/// The ids a request generates, or its error.
fn tokens(stream: super::RequestStream) -> Result<Vec<u32>, Error> {
    let mut ids = Vec::new();
    for event in stream {
        match event? {
            Event::Token(t) => ids.push(t.id),
            Event::Done(finish) => {
                assert!(matches!(finish.reason, StopReason::MaxTokens | StopReason::StopToken(_)), "{finish:?}");
                return Ok(ids);
            }
        }
    }
    Err(EngineError::ShutDown.into())
}

type TestResult = Result<(), Box<dyn std::error::Error>>;

#[test]
fn a_panic_in_a_round_fails_the_running_requests_and_the_engine_goes_on() -> TestResult {
    let engine = tiny_engine()?;
    let alone = tokens(engine.submit(request(6))?)?;
    // The next round with a request running panics: that request ends with the panic's error.
    engine.inject(Fault::Round);
    let failed = tokens(engine.submit(request(200))?);
    let message = failed.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(message.contains("a fault injected in a round"), "{message}");
    assert_eq!(engine.metrics().worker_panics.load(Ordering::SeqCst), 1);
    assert_eq!(engine.health(), EngineHealth::Serving);
    // Later requests answer as before the panic.
    let after = tokens(engine.submit(request(6))?)?;
    assert_eq!(after, alone);
    assert_eq!(engine.metrics().running.load(Ordering::SeqCst), 0);
    Ok(())
}

#[test]
fn a_worker_that_cannot_go_on_is_reported_failed() -> TestResult {
    let engine = tiny_engine()?;
    engine.inject(Fault::Worker);
    let started = std::time::Instant::now();
    while engine.health() == EngineHealth::Serving {
        assert!(started.elapsed() < std::time::Duration::from_secs(30), "the worker did not stop");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let health = engine.health();
    assert!(
        matches!(&health, EngineHealth::Failed { reason } if reason.contains("a fault injected outside the rounds")),
        "{health:?}"
    );
    let refused = engine.submit(request(4)).err();
    assert!(matches!(refused, Some(Error::Engine(EngineError::WorkerFailed { .. }))), "{refused:?}");
    Ok(())
}

#[test]
fn huge_token_budgets_are_held_to_the_sequence() -> TestResult {
    let engine = tiny_engine()?;
    // 2^62 and usize::MAX new tokens: no overflow, no allocation of what they ask; the
    // sequence ends when its positions are full.
    for max in [1usize << 62, usize::MAX] {
        let stream = engine.submit(request(max))?;
        let mut last = None;
        for event in stream {
            last = Some(event?);
        }
        match last {
            Some(Event::Done(finish)) => {
                assert!(matches!(finish.reason, StopReason::ContextFull | StopReason::StopToken(_)), "{finish:?}");
                assert!(finish.prompt_tokens + finish.generated_tokens <= engine.sequence_positions() + 1);
            }
            other => return Err(format!("the stream ended with {other:?}").into()),
        }
    }
    assert_eq!(engine.health(), EngineHealth::Serving);
    Ok(())
}

#[test]
fn drafts_are_shared_a_token_at_a_time_within_the_budget() {
    // (drafts per sequence, budget) -> kept per sequence
    for (lengths, budget, kept) in [
        (vec![4, 4, 4], 20, vec![4, 4, 4]),
        (vec![4, 0, 2, 4], 5, vec![2, 0, 2, 1]),
        (vec![4, 1, 4], 7, vec![3, 1, 3]),
        (vec![3, 3], 0, vec![0, 0]),
    ] {
        let mut drafts: Vec<Vec<u32>> = lengths.iter().map(|&n| (0..n as u32).collect()).collect();
        share_drafts(&mut drafts, budget);
        let got: Vec<usize> = drafts.iter().map(Vec::len).collect();
        assert_eq!(got, kept, "{lengths:?} within {budget}");
        // Each keeps its first drafts.
        assert!(drafts.iter().all(|d| d.iter().enumerate().all(|(i, &t)| t == i as u32)));
    }
}

#[test]
fn steps_run_power_of_two_rows_within_the_cache() {
    // (generating, cache's sequences) -> rows stepped
    for (n, batch, rows) in [(1, 16, 1), (3, 16, 4), (8, 16, 8), (9, 16, 16), (9, 12, 12), (12, 12, 12), (33, 64, 64)] {
        assert_eq!(step_rows(n, batch), rows, "{n} of {batch}");
    }
}

/// Text and chat prompts are the engine's own tokenizing of what a caller would send as ids:
/// the chat laid out by the model's template, `<bos>` first; bad ones are refused at submit.
#[test]
fn text_and_chat_prompts_match_their_ids() -> TestResult {
    use super::Prompt;
    use crate::chat::{ChatError, ChatMessage, ChatTemplate};
    use crate::{tokenizer::Bos, RequestError};
    let engine = tiny_engine()?;
    let generation = request(5).generation;
    let chat = vec![ChatMessage::system("w300"), ChatMessage::user("w301 w302")];
    let text = ChatTemplate::Gemma.render(&chat)?;
    let ids = engine.tokenizer().encode(&text, Bos::Prepend)?;
    assert_eq!(ids[0], 2);
    assert_eq!(engine.prompt_ids(Prompt::Chat(chat.clone()), &[])?, ids);
    let by_ids = tokens(engine.submit(Request::new(ids.clone(), generation.clone()))?)?;
    let by_chat = tokens(engine.submit(Request::chat(chat, generation.clone()))?)?;
    let by_text = tokens(engine.submit(Request::text(text, generation.clone()))?)?;
    assert_eq!(by_chat, by_ids);
    assert_eq!(by_text, by_ids);
    let refused = |prompt: Prompt| engine.submit(Request { prompt, ..request(5) }).err().map(|e| e.to_string());
    let empty = Error::from(RequestError::EmptyPrompt).to_string();
    assert_eq!(refused(Prompt::Text(String::new())), Some(empty));
    let last = Error::from(ChatError::LastNotUser).to_string();
    assert_eq!(refused(Prompt::Chat(vec![ChatMessage::user("w300"), ChatMessage::assistant("w301")])), Some(last));
    Ok(())
}
