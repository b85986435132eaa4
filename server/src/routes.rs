//! The HTTP API: OpenAI's completions and chat completions (whole or streamed as server-sent
//! events), the model list, health, Prometheus metrics and the engine's scope tree.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::stream;
use ndscope::data::{ChatMessage, ChatTemplate, Tokenizer};
use ndscope::serve::{Finish, RequestId};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use crate::engine::{Command, EngineHandle, Job, ModelFacts, Update};
use crate::metrics::Metrics;
use crate::openai::{self, ApiError, Asked, Limits, PromptInput};
use crate::text::TextStream;

/// What every handler shares.
pub struct App {
    pub name: String,
    pub facts: ModelFacts,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    pub engine: EngineHandle,
    pub metrics: Arc<Metrics>,
    pub max_batch: usize,
    pub max_body: usize,
    pub ending: AtomicBool,
    pub started: u64,
    next_id: AtomicU64,
}

impl App {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: String,
        facts: ModelFacts,
        tokenizer: Tokenizer,
        template: Option<ChatTemplate>,
        engine: EngineHandle,
        metrics: Arc<Metrics>,
        max_batch: usize,
        max_body: usize,
    ) -> App {
        App {
            name,
            facts,
            tokenizer: Arc::new(tokenizer),
            template,
            engine,
            metrics,
            max_batch,
            max_body,
            ending: AtomicBool::new(false),
            started: unix_now(),
            next_id: AtomicU64::new(0),
        }
    }

    fn limits(&self) -> Limits {
        Limits {
            max_positions: self.facts.max_positions,
            max_batch: self.max_batch,
            end_tokens: self.facts.end_tokens.clone(),
        }
    }
}

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/debug/scopes", get(scopes))
        .fallback(not_found)
        .with_state(app)
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn error_response(app: &App, e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    match e.status {
        400 => app.metrics.outcome("rejected"),
        429 => app.metrics.outcome("overloaded"),
        _ => {}
    }
    let mut response = (status, axum::Json(e.body())).into_response();
    if e.status == 429 {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}

fn unavailable(message: &str) -> ApiError {
    ApiError {
        status: 503,
        message: message.into(),
        kind: "server_error",
        param: None,
        code: None,
    }
}

async fn not_found(State(app): State<Arc<App>>) -> Response {
    let e = ApiError {
        status: 404,
        kind: "invalid_request_error",
        code: Some("not_found"),
        ..ApiError::invalid(
            "no such endpoint; this server has POST /v1/completions, POST /v1/chat/completions, \
             GET /v1/models, GET /health, GET /metrics, GET /debug/scopes",
            None,
        )
    };
    error_response(&app, &e)
}

async fn health(State(app): State<Arc<App>>) -> Response {
    if app.ending.load(Ordering::Relaxed) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "shutting down"})),
        )
            .into_response()
    } else {
        axum::Json(json!({"status": "ok"})).into_response()
    }
}

async fn models(State(app): State<Arc<App>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": app.name,
            "object": "model",
            "created": app.started,
            "owned_by": "ndscope",
            "max_model_len": app.facts.max_positions,
            "architecture": app.facts.architecture,
        }],
    }))
    .into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.render(),
    )
        .into_response()
}

/// The engine thread's scope tree (the model, the KV pool, the running requests' caches).
async fn scopes(State(app): State<Arc<App>>) -> Response {
    let (reply, answer) = oneshot::channel();
    if !app.engine.send(Command::Dump(reply)) {
        return error_response(&app, &unavailable("the engine has ended"));
    }
    match answer.await {
        Ok(dump) => ([(header::CONTENT_TYPE, "text/plain")], dump).into_response(),
        Err(_) => error_response(&app, &unavailable("the engine has ended")),
    }
}

async fn read_body(app: &App, body: Body) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, app.max_body).await.map_err(|_| {
        ApiError::invalid(
            format!(
                "the body is over {} bytes, or was cut off; send less (the limit is --max-body)",
                app.max_body
            ),
            None,
        )
    })
}

async fn completions(State(app): State<Arc<App>>, body: Body) -> Response {
    match completions_checked(&app, body).await {
        Ok(response) => response,
        Err(e) => error_response(&app, &e),
    }
}

async fn completions_checked(app: &Arc<App>, body: Body) -> Result<Response, ApiError> {
    let body: openai::CompletionBody = openai::parse(&read_body(app, body).await?)?;
    openai::check_model(&body.model, &app.name)?;
    if body.echo == Some(true) {
        return Err(ApiError::invalid(
            "echo is not supported; the prompt is yours already",
            Some("echo"),
        ));
    }
    let logprobs = match body.logprobs {
        None => None,
        Some(k @ 0..=5) => Some(k as usize),
        Some(k) => {
            return Err(ApiError::invalid(
                format!("logprobs must be between 0 and 5, got {k}"),
                Some("logprobs"),
            ));
        }
    };
    let prompt = match openai::prompt_input(body.prompt, app.facts.vocab_size)? {
        PromptInput::Ids(ids) => ids,
        // As transformers' `tokenizer(text)` and OpenAI-compatible servers do: with the special
        // tokens the tokenizer adds (Llama's beginning of text). Chat templates write their own.
        PromptInput::Text(text) => app
            .tokenizer
            .encode_with_special_tokens(&text)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))?,
    };
    let asked = openai::asked(
        &body.sampling,
        body.max_tokens,
        Some(16),
        prompt.len(),
        "prompt",
        &app.limits(),
    )?;
    let kind = Kind::Text { logprobs };
    let include_usage = body
        .stream_options
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    respond(
        app,
        prompt,
        asked,
        kind,
        body.stream.unwrap_or(false),
        include_usage,
    )
    .await
}

async fn chat_completions(State(app): State<Arc<App>>, body: Body) -> Response {
    match chat_checked(&app, body).await {
        Ok(response) => response,
        Err(e) => error_response(&app, &e),
    }
}

async fn chat_checked(app: &Arc<App>, body: Body) -> Result<Response, ApiError> {
    let body: openai::ChatBody = openai::parse(&read_body(app, body).await?)?;
    openai::check_model(&body.model, &app.name)?;
    let Some(template) = &app.template else {
        return Err(ApiError::invalid(
            format!(
                "the model `{}` has no chat template (a base model); use /v1/completions",
                app.name
            ),
            Some("messages"),
        ));
    };
    let messages: Vec<ChatMessage> = openai::chat_messages(body.messages)?
        .into_iter()
        .map(|(role, text)| ChatMessage::new(role, text))
        .collect();
    let text = template
        .apply(&messages, true)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    let prompt = app
        .tokenizer
        .encode(&text)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    let logprobs = match (body.logprobs.unwrap_or(false), body.top_logprobs) {
        (_, Some(k)) if !(0..=20).contains(&k) => {
            return Err(ApiError::invalid(
                format!("top_logprobs must be between 0 and 20, got {k}"),
                Some("top_logprobs"),
            ));
        }
        (false, Some(k)) if k > 0 => {
            return Err(ApiError::invalid(
                "top_logprobs needs logprobs: true",
                Some("top_logprobs"),
            ));
        }
        (on, _) => on,
    };
    let asked = openai::asked(
        &body.sampling,
        body.max_completion_tokens.or(body.max_tokens),
        None,
        prompt.len(),
        "messages",
        &app.limits(),
    )?;
    let include_usage = body
        .stream_options
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let kind = Kind::Chat { logprobs };
    respond(
        app,
        prompt,
        asked,
        kind,
        body.stream.unwrap_or(false),
        include_usage,
    )
    .await
}

/// Which API's shapes the answer takes.
#[derive(Debug, Clone, Copy)]
enum Kind {
    /// `/v1/completions`; `logprobs` asked for.
    Text { logprobs: Option<usize> },
    /// `/v1/chat/completions`.
    Chat { logprobs: bool },
}

impl Kind {
    fn wants_logprobs(self) -> bool {
        match self {
            Kind::Text { logprobs } => logprobs.is_some(),
            Kind::Chat { logprobs } => logprobs,
        }
    }
}

/// Ends the request's samples in the engine when dropped: a handler that returns early, or a
/// stream whose client went away, gives the blocks back at once (samples that finished are
/// skipped by the engine).
struct Submitted {
    ids: Vec<RequestId>,
    engine: EngineHandle,
}

impl Drop for Submitted {
    fn drop(&mut self) {
        let ids = std::mem::take(&mut self.ids);
        self.engine.send(Command::End {
            ids,
            outcome: "cancelled",
        });
    }
}

/// One sample's text and tokens so far.
struct Sample {
    text: TextStream,
    tokens: Vec<i64>,
    logprobs: Vec<f32>,
    /// Byte offsets of each token's text (`text_offset`).
    offsets: Vec<usize>,
    finish: Option<&'static str>,
}

/// What one update changed in a sample: new text, the token (for logprobs), and the end.
struct Progress {
    sample: usize,
    delta: String,
    token: Option<(i64, f32)>,
    finish: Option<&'static str>,
}

async fn submit(
    app: &App,
    prompt: Vec<i64>,
    asked: &Asked,
) -> Result<(Submitted, mpsc::UnboundedReceiver<Update>), ApiError> {
    if app.ending.load(Ordering::Relaxed) {
        return Err(unavailable("the server is shutting down; retry on another"));
    }
    let (updates, receiver) = mpsc::unbounded_channel();
    let (reply, answer) = oneshot::channel();
    let job = Job {
        prompt,
        options: asked.options.clone(),
        n: asked.n,
    };
    if !app.engine.send(Command::Submit {
        job,
        updates,
        reply,
    }) {
        return Err(unavailable("the engine has ended"));
    }
    match answer.await {
        Ok(Ok(ids)) => Ok((
            Submitted {
                ids,
                engine: app.engine.clone(),
            },
            receiver,
        )),
        Ok(Err(ndscope::Error::Overloaded { waiting, limit })) => Err(ApiError {
            status: 429,
            message: format!(
                "the server is busy: {waiting} requests wait (at most {limit}); retry after a second"
            ),
            kind: "rate_limit_exceeded",
            param: None,
            code: Some("rate_limit_exceeded"),
        }),
        Ok(Err(e)) => Err(ApiError::invalid(e.to_string(), None)),
        Err(_) => Err(unavailable("the engine has ended")),
    }
}

/// Applies `update` to its sample; `None` when it changes nothing the client sees. A stop string
/// met ends the sample in the engine at once.
fn advance(
    app: &App,
    samples: &mut [Sample],
    submitted: &Submitted,
    update: Update,
) -> Result<Option<Progress>, ApiError> {
    match update {
        Update::Token {
            sample,
            token,
            logprob,
        } => {
            let s = &mut samples[sample];
            if s.finish.is_some() {
                return Ok(None);
            }
            s.offsets.push(s.text.text().len());
            s.tokens.push(token);
            s.logprobs.push(logprob);
            let delta = if app.facts.end_tokens.contains(&token) {
                String::new() // the end of text is not text
            } else {
                s.text.push(token)
            };
            if s.text.stopped() {
                s.finish = Some("stop");
                submitted.engine.send(Command::End {
                    ids: vec![submitted.ids[sample]],
                    outcome: "stop",
                });
            }
            Ok(Some(Progress {
                sample,
                delta,
                token: Some((token, logprob)),
                finish: s.finish,
            }))
        }
        Update::Finished { sample, finish } => {
            let s = &mut samples[sample];
            if s.finish.is_some() {
                return Ok(None);
            }
            let delta = s.text.finish();
            let reason = match finish {
                Finish::Stop(_) => "stop",
                Finish::Length | Finish::Positions => "length",
            };
            s.finish = Some(reason);
            Ok(Some(Progress {
                sample,
                delta,
                token: None,
                finish: Some(reason),
            }))
        }
        Update::Failed { message, .. } => Err(ApiError {
            status: 500,
            message: format!("the engine failed this request: {message}"),
            kind: "server_error",
            param: None,
            code: None,
        }),
    }
}

async fn respond(
    app: &Arc<App>,
    prompt: Vec<i64>,
    asked: Asked,
    kind: Kind,
    stream: bool,
    include_usage: bool,
) -> Result<Response, ApiError> {
    let prompt_tokens = prompt.len();
    let (submitted, updates) = submit(app, prompt, &asked).await?;
    let samples: Vec<Sample> = (0..asked.n)
        .map(|_| Sample {
            text: TextStream::new(app.tokenizer.clone(), asked.stops.clone()),
            tokens: Vec::new(),
            logprobs: Vec::new(),
            offsets: Vec::new(),
            finish: None,
        })
        .collect();
    let serial = app.next_id.fetch_add(1, Ordering::Relaxed);
    let id = match kind {
        Kind::Text { .. } => format!("cmpl-{serial}"),
        Kind::Chat { .. } => format!("chatcmpl-{serial}"),
    };
    let reply = Reply {
        app: app.clone(),
        id,
        created: unix_now(),
        kind,
        prompt_tokens,
    };
    if stream {
        Ok(stream_reply(
            reply,
            submitted,
            updates,
            samples,
            include_usage,
        ))
    } else {
        whole_reply(reply, submitted, updates, samples).await
    }
}

/// The facts every answer of one request repeats.
struct Reply {
    app: Arc<App>,
    id: String,
    created: u64,
    kind: Kind,
    prompt_tokens: usize,
}

impl Reply {
    fn token_text(&self, token: i64) -> String {
        self.app.tokenizer.decode(&[token]).unwrap_or_default()
    }

    fn usage(&self, samples: &[Sample]) -> Value {
        let completion: usize = samples.iter().map(|s| s.tokens.len()).sum();
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        })
    }

    /// The log-probabilities of `tokens` in the API's shape (only the chosen token's: the
    /// engine reports no alternatives).
    fn logprobs(&self, tokens: &[i64], logprobs: &[f32], offsets: &[usize]) -> Value {
        if !self.kind.wants_logprobs() {
            return Value::Null;
        }
        let texts: Vec<String> = tokens.iter().map(|&t| self.token_text(t)).collect();
        match self.kind {
            Kind::Text { logprobs: k } => json!({
                "tokens": texts,
                "token_logprobs": logprobs,
                "top_logprobs": if k.unwrap_or(0) > 0 {
                    json!(texts.iter().zip(logprobs).map(|(t, l)| json!({t.as_str(): l})).collect::<Vec<_>>())
                } else {
                    Value::Null
                },
                "text_offset": offsets,
            }),
            Kind::Chat { .. } => json!({
                "content": texts.iter().zip(logprobs).map(|(t, l)| json!({
                    "token": t,
                    "logprob": l,
                    "bytes": t.as_bytes(),
                    "top_logprobs": [],
                })).collect::<Vec<_>>(),
            }),
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Text { .. }, _) => "text_completion",
            (Kind::Chat { .. }, false) => "chat.completion",
            (Kind::Chat { .. }, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, choices: Value, chunk: bool) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.app.name,
            "choices": choices,
        })
    }

    /// One streamed chunk of `p`.
    fn chunk(&self, p: &Progress, samples: &[Sample]) -> Value {
        let s = &samples[p.sample];
        let logprobs = match p.token {
            Some((t, l)) => self.logprobs(&[t], &[l], &[*s.offsets.last().unwrap_or(&0)]),
            None => Value::Null,
        };
        let choice = match self.kind {
            Kind::Text { .. } => json!({
                "index": p.sample,
                "text": p.delta,
                "logprobs": logprobs,
                "finish_reason": p.finish,
            }),
            Kind::Chat { .. } => json!({
                "index": p.sample,
                "delta": if p.delta.is_empty() { json!({}) } else { json!({"content": p.delta}) },
                "logprobs": logprobs,
                "finish_reason": p.finish,
            }),
        };
        self.envelope(json!([choice]), true)
    }

    fn whole(&self, samples: &[Sample]) -> Value {
        let choices: Vec<Value> = samples
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let logprobs = self.logprobs(&s.tokens, &s.logprobs, &s.offsets);
                match self.kind {
                    Kind::Text { .. } => json!({
                        "index": i,
                        "text": s.text.text(),
                        "logprobs": logprobs,
                        "finish_reason": s.finish,
                    }),
                    Kind::Chat { .. } => json!({
                        "index": i,
                        "message": {"role": "assistant", "content": s.text.text()},
                        "logprobs": logprobs,
                        "finish_reason": s.finish,
                    }),
                }
            })
            .collect();
        let mut body = self.envelope(json!(choices), false);
        body["usage"] = self.usage(samples);
        body
    }
}

async fn whole_reply(
    reply: Reply,
    submitted: Submitted,
    mut updates: mpsc::UnboundedReceiver<Update>,
    mut samples: Vec<Sample>,
) -> Result<Response, ApiError> {
    while samples.iter().any(|s| s.finish.is_none()) {
        let Some(update) = updates.recv().await else {
            return Err(unavailable("the engine ended before the request did"));
        };
        advance(&reply.app, &mut samples, &submitted, update)?;
    }
    Ok(axum::Json(reply.whole(&samples)).into_response())
}

fn stream_reply(
    reply: Reply,
    submitted: Submitted,
    mut updates: mpsc::UnboundedReceiver<Update>,
    mut samples: Vec<Sample>,
    include_usage: bool,
) -> Response {
    let (out, events) = mpsc::channel::<SseEvent>(64);
    let data = |v: &Value| SseEvent::default().data(v.to_string());
    tokio::spawn(async move {
        // `submitted` lives as long as this task: when the client goes away, the task ends and
        // the samples end with it.
        let submitted = submitted;
        if let Kind::Chat { .. } = reply.kind {
            for i in 0..samples.len() {
                let choice = json!([{"index": i, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": null, "finish_reason": null}]);
                if out.send(data(&reply.envelope(choice, true))).await.is_err() {
                    return;
                }
            }
        }
        while samples.iter().any(|s| s.finish.is_none()) {
            let update = tokio::select! {
                update = updates.recv() => update,
                () = out.closed() => return,
            };
            let progress = match update.map(|u| advance(&reply.app, &mut samples, &submitted, u)) {
                Some(Ok(Some(p))) => p,
                Some(Ok(None)) => continue,
                Some(Err(e)) => {
                    let _ = out.send(data(&e.body())).await;
                    return;
                }
                None => {
                    let e = unavailable("the engine ended before the request did");
                    let _ = out.send(data(&e.body())).await;
                    return;
                }
            };
            let visible = !progress.delta.is_empty()
                || progress.finish.is_some()
                || (progress.token.is_some() && reply.kind.wants_logprobs());
            if visible
                && out
                    .send(data(&reply.chunk(&progress, &samples)))
                    .await
                    .is_err()
            {
                return;
            }
        }
        if include_usage {
            let mut last = reply.envelope(json!([]), true);
            last["usage"] = reply.usage(&samples);
            if out.send(data(&last)).await.is_err() {
                return;
            }
        }
        let _ = out.send(SseEvent::default().data("[DONE]")).await;
    });
    let body = stream::unfold(events, |mut events| async move {
        events
            .recv()
            .await
            .map(|e| (Ok::<_, Infallible>(e), events))
    });
    Sse::new(body)
        .keep_alive(KeepAlive::default())
        .into_response()
}
