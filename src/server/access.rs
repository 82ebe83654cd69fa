//! Who gets in, and what every refusal looks like: the API key, the JSON content type, CORS,
//! and OpenAI's JSON error body for every error status (404, 405, 413 ... included).

use super::{
    config::{Access, ConfigError, Cors},
    openai::ApiError,
};
use axum::{
    body::Body,
    extract::Request,
    http::{header, HeaderValue, Method, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
};
use std::sync::Arc;
use tower_http::cors::{AllowOrigin, CorsLayer};

/// Paths that answer without a key: health probes carry none.
const OPEN_PATHS: [&str; 2] = ["/health", "/ready"];

/// Refuses a request without one of `access`'s keys (where it has any), and a `POST` whose
/// body is not declared JSON. (A page on any web site can `POST` `text/plain` to a server on
/// 127.0.0.1 without a CORS preflight: requiring `application/json` stops that.)
pub(super) async fn guard(access: Arc<Access>, request: Request, next: Next) -> Response {
    if !access.api_keys.is_empty() && !OPEN_PATHS.contains(&request.uri().path()) && request.method() != Method::OPTIONS
    {
        let presented = request.headers().get(header::AUTHORIZATION).and_then(|v| bearer(v.as_bytes()));
        let known = presented.is_some_and(|key| access.api_keys.iter().any(|k| k.matches(key)));
        if !known {
            let message = match presented {
                None => "an API key is needed: send it as `Authorization: Bearer <key>`",
                Some(_) => "the API key is not one this server knows",
            };
            let mut response =
                ApiError::new(StatusCode::UNAUTHORIZED, message).with_code("invalid_api_key").into_response();
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return response;
        }
    }
    if request.method() == Method::POST && !declares_json(request.headers().get(header::CONTENT_TYPE)) {
        let message = "the request body must be JSON, sent with `Content-Type: application/json`";
        return ApiError::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, message).into_response();
    }
    next.run(request).await
}

/// The token of an `Authorization: Bearer <token>` header (the scheme in any case, as HTTP
/// has it).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, token) = value.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then(|| token.trim_ascii())
}

/// Whether a `Content-Type` is `application/json` (any parameters, such as a charset).
fn declares_json(content_type: Option<&HeaderValue>) -> bool {
    let Some(value) = content_type.and_then(|v| v.to_str().ok()) else { return false };
    let essence = value.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json")
}

/// Gives every error response without a JSON body OpenAI's error shape, so that a client
/// parses a 404, a 405 or a 408 as it parses a 400.
pub(super) async fn json_errors(response: Response) -> Response {
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (parts, body) = response.into_parts();
    // A short plain-text reason (axum's rejections give one) goes into the message.
    let detail = axum::body::to_bytes(body, 1024).await.ok().and_then(|b| String::from_utf8(b.to_vec()).ok());
    let reason = status.canonical_reason().unwrap_or("error");
    let message = match detail.as_deref().map(str::trim) {
        Some(d) if !d.is_empty() => format!("{reason}: {d}"),
        _ => reason.to_string(),
    };
    let mut json = ApiError::new(status, message).into_response();
    // Headers the response carried (allow, retry-after, CORS) stay.
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            json.headers_mut().insert(name, value.clone());
        }
    }
    json
}

/// The CORS layer for `cors`, or none where it is off.
pub(super) fn cors_layer(cors: &Cors) -> Result<Option<CorsLayer>, ConfigError> {
    let origins = match cors {
        Cors::Off => return Ok(None),
        Cors::AnyOrigin => AllowOrigin::any(),
        Cors::Origins(list) => {
            let mut values = Vec::with_capacity(list.len());
            for given in list {
                let origin = given.trim_end_matches('/');
                let host = origin.strip_prefix("https://").or_else(|| origin.strip_prefix("http://"));
                let well_formed = host.is_some_and(|h| !h.is_empty() && !h.contains(['/', ' ']));
                let value = HeaderValue::from_str(origin).ok().filter(|_| well_formed);
                values.push(value.ok_or_else(|| ConfigError::BadOrigin(given.clone()))?);
            }
            AllowOrigin::list(values)
        }
    };
    Ok(Some(
        CorsLayer::new()
            .allow_origin(origins)
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]),
    ))
}

/// A 404 naming what was asked for.
pub(super) async fn not_found(request: Request<Body>) -> Response {
    let message = format!("no route for {} {}", request.method(), request.uri().path());
    ApiError::new(StatusCode::NOT_FOUND, message).into_response()
}

/// A 405 naming the method and the path.
pub(super) async fn method_not_allowed(request: Request<Body>) -> Response {
    let message = format!("{} is not allowed on {}", request.method(), request.uri().path());
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, message).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_content_types_are_recognized() {
        for (value, json) in [
            ("application/json", true),
            ("application/json; charset=utf-8", true),
            ("Application/JSON", true),
            ("text/plain", false),
            ("application/x-www-form-urlencoded", false),
            ("multipart/form-data; boundary=x", false),
            ("application/jsonp", false),
        ] {
            assert_eq!(declares_json(Some(&HeaderValue::from_static(value))), json, "{value}");
        }
        assert!(!declares_json(None));
    }

    #[test]
    fn origins_must_be_origins() {
        assert!(cors_layer(&Cors::Off).is_ok_and(|l| l.is_none()));
        assert!(cors_layer(&Cors::Origins(vec!["https://app.example.com".into()])).is_ok_and(|l| l.is_some()));
        for bad in ["app.example.com", "https://a.com/path", "ftp://a.com", "https://a b"] {
            assert!(cors_layer(&Cors::Origins(vec![bad.into()])).is_err(), "{bad}");
        }
    }
}
