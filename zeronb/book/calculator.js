// Chapter 6's memory calculator, answering in the rendered page with no kernel (zeronb/book/page.py
// writes the HTML around it). What it computes is zeronb.book.calculator's, and is tested against it
// in a browser (tests/test_browser.py): the bytes per parameter come from Python as data; the sharding
// rule (zeronb.memory.model_state_breakdown), the parsing of "7.5B" (parse_num_params) and the line of
// text (describe), with Python's number formatting, are repeated here.
(function () {
  "use strict";
  if (window.zeronbCalc) { window.zeronbCalc.initAll(); return; }
  var ROLES = ["params", "grads", "optimizer"];
  var COLORS = { params: "#1f77b4", grads: "#ff7f0e", optimizer: "#2ca02c" };  // matplotlib's C0, C1, C2
  var SUFFIXES = { "": 1, K: 1e3, M: 1e6, B: 1e9, G: 1e9, T: 1e12 };

  // Python's repr of a str (the error messages quote the input as Python would)
  function pyRepr(s) {
    return s.indexOf("'") >= 0 && s.indexOf('"') < 0 ? '"' + s + '"' : "'" + s.replace(/'/g, "\\'") + "'";
  }

  // x rounded to `sig` significant digits, half to even as Python's format() does: {digits, exp}
  function roundSig(x, sig) {
    var s = Math.abs(x).toExponential(99);               // the double's exact decimal digits (<= 100)
    var mant = s.split("e")[0].replace(".", ""), exp = parseInt(s.split("e")[1], 10);
    var keep = mant.slice(0, sig), rest = mant.slice(sig);
    var up = rest[0] > "5" || (rest[0] === "5" && (/[1-9]/.test(rest.slice(1)) || (+keep[sig - 1]) % 2 === 1));
    if (up) {
      var n = (BigInt(keep) + 1n).toString();
      if (n.length > sig) { n = n.slice(0, sig); exp += 1; }
      keep = n;
    }
    return { digits: keep, exp: exp };
  }

  function stripZeros(s) { return s.indexOf(".") < 0 ? s : s.replace(/0+$/, "").replace(/\.$/, ""); }

  // Python's format(x, ".{p}g")
  function fmtG(x, p) {
    if (x === 0) return "0";
    var r = roundSig(x, p), sign = x < 0 ? "-" : "", d = r.digits;
    if (r.exp < -4 || r.exp >= p) {
      var m = stripZeros(d[0] + "." + d.slice(1));
      return sign + m + "e" + (r.exp < 0 ? "-" : "+") + String(Math.abs(r.exp)).padStart(2, "0");
    }
    var s = r.exp >= 0 ? d.slice(0, r.exp + 1) + "." + d.slice(r.exp + 1)
                       : "0." + "0".repeat(-r.exp - 1) + d;
    return sign + stripZeros(s);
  }

  // Python's format(x, ",.0f") for x >= 0: half to even, thousands separated
  function fmtThousands(x) {
    var f = Math.floor(x), n = x - f > 0.5 || (x - f === 0.5 && f % 2 === 1) ? f + 1 : f;
    return BigInt(n).toString().replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  }

  function parseNumParams(text) {
    var m = /^\s*([0-9][0-9_,]*\.?[0-9]*(?:e[+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*$/.exec(text);
    if (!m) {
      throw new Error("number of parameters: expected a number such as 7.5e9 or '7.5B' (suffixes K, M, B, T), not "
                      + pyRepr(text));
    }
    var number = Number(m[1].replace(/[,_]/g, "")) * SUFFIXES[m[2].toUpperCase()];
    if (!isFinite(number) || number <= 0) {
      throw new Error("number of parameters must be a positive, finite number, not " + pyRepr(text));
    }
    return number;
  }

  function parseWorldSize(text) {
    if (!/^\s*[0-9]+\s*$/.test(text) || +text < 1) {
      throw new Error("world_size (number of ranks) must be a whole number >= 1, not " + pyRepr(text));
    }
    return parseInt(text, 10);
  }

  // zeronb.book.calculator.calculate, with zeronb.memory.model_state_breakdown's rule
  function calculate(data, psi, n, stage, precision, optimizer) {
    var per = data.bytes_per_param[precision][optimizer], stages = {};
    for (var s = 0; s < 4; s++) {
      var shard = { params: s >= 3, grads: s >= 2, optimizer: s >= 1 }, b = {};
      ROLES.forEach(function (role) { b[role] = per[role] * psi / (shard[role] ? n : 1); });
      stages[s] = b;
    }
    function total(b) { return 0 + b.params + b.grads + b.optimizer; }
    var mine = stages[stage], t = total(mine), ddp = total(stages[0]);
    return { num_params: psi, world_size: n, stage: stage, precision: precision, optimizer: optimizer,
             bytes_per_param: per, bytes: mine, total: t, ddp_total: ddp,
             fraction_of_ddp: ddp ? t / ddp : 1.0, reduction: t ? ddp / t : 1.0, stages: stages };
  }

  function formatCount(n) {
    var scales = [["T", 1e12], ["B", 1e9], ["M", 1e6], ["K", 1e3]];
    for (var i = 0; i < scales.length; i++) if (n >= scales[i][1]) return fmtG(n / scales[i][1], 4) + scales[i][0];
    return fmtG(n, 4);
  }

  function unitFor(nbytes) {
    var units = [["TB", 1e12], ["GB", 1e9], ["MB", 1e6], ["kB", 1e3]];
    for (var i = 0; i < units.length; i++) if (nbytes >= units[i][1]) return units[i];
    return ["bytes", 1.0];
  }

  function formatBytes(nbytes) { var u = unitFor(nbytes); return fmtG(nbytes / u[1], 3) + " " + u[0]; }

  function describe(data, r) {
    var per = r.bytes_per_param, n = r.world_size, versus;
    var parts = ROLES.map(function (role) { return role + " " + formatBytes(r.bytes[role]); }).join(" + ");
    if (r.stage === 0) versus = "every rank holds all of it";
    else if (n === 1) versus = "the same as DDP: with one rank there is nothing to share";
    else if (r.total === r.ddp_total) versus = "the same as DDP: what this stage shards takes no memory here";
    else versus = fmtG(100 * r.fraction_of_ddp, 3) + "% of DDP's " + formatBytes(r.ddp_total) + ", "
                  + (r.reduction >= 100 ? fmtThousands(r.reduction) : fmtG(r.reduction, 3)) + "x less";
    return data.stage_names[r.stage] + ", " + formatCount(r.num_params) + " parameters on " + n + " rank"
      + (n > 1 ? "s" : "") + ", " + r.precision + " " + data.optimizers[r.optimizer] + " ("
      + fmtG(per.params, 6) + " + " + fmtG(per.grads, 6) + " + " + fmtG(per.optimizer, 6) + " = "
      + fmtG(per.params + per.grads + per.optimizer, 6) + " bytes per parameter): " + formatBytes(r.total)
      + " per device (" + parts + "); " + versus;
  }

  // the bars of zeronb.book.calculator.draw, as SVG
  function chart(data, r) {
    var W = 560, H = 300, left = 60, right = 110, top = 34, bottom = 46, plotW = W - left - right, plotH = H - top - bottom;
    var totals = [0, 1, 2, 3].map(function (s) { var b = r.stages[s]; return b.params + b.grads + b.optimizer; });
    var u = unitFor(Math.max.apply(null, totals)), ymax = Math.max.apply(null, totals) / u[1] * 1.15 || 1;
    var y = function (v) { return top + plotH - v / ymax * plotH; }, out = [];
    out.push('<svg xmlns="http://www.w3.org/2000/svg" width="' + W + '" height="' + H + '" font-family="sans-serif" font-size="11">');
    out.push('<text x="' + (left + plotW / 2) + '" y="16" text-anchor="middle" font-size="12">' + formatCount(r.num_params)
             + " parameters, N = " + r.world_size + " ranks, " + r.precision + " " + data.optimizers[r.optimizer] + "</text>");
    var slot = plotW / 4;
    out.push('<rect x="' + (left + r.stage * slot + 4) + '" y="' + top + '" width="' + (slot - 8) + '" height="' + plotH
             + '" fill="gold" opacity="0.25"/>');
    for (var s = 0; s < 4; s++) {
      var chosen = s === r.stage, x = left + s * slot + slot * 0.175, w = slot * 0.65, base = 0;
      ROLES.forEach(function (role) {
        var v = r.stages[s][role] / u[1];
        out.push('<rect data-stage="' + s + '" data-role="' + role + '" x="' + x + '" y="' + y(base + v) + '" width="' + w
                 + '" height="' + (y(base) - y(base + v)) + '" fill="' + COLORS[role] + '" fill-opacity="' + (chosen ? 1 : 0.4)
                 + '"' + (chosen ? ' stroke="black" stroke-width="1.2"' : "") + "/>");
        base += v;
      });
      out.push('<text x="' + (x + w / 2) + '" y="' + (y(base) - 4) + '" text-anchor="middle"' + (chosen ? ' font-weight="bold"' : "")
               + ">" + fmtG(base, 3) + "</text>");
      out.push('<text x="' + (x + w / 2) + '" y="' + (top + plotH + 16) + '" text-anchor="middle"' + (chosen ? ' font-weight="bold"' : "")
               + ">" + data.stage_names[s] + "</text>");
    }
    out.push('<line x1="' + left + '" y1="' + (top + plotH) + '" x2="' + (left + plotW) + '" y2="' + (top + plotH) + '" stroke="black"/>');
    out.push('<line x1="' + left + '" y1="' + top + '" x2="' + left + '" y2="' + (top + plotH) + '" stroke="black"/>');
    out.push('<text transform="translate(16,' + (top + plotH / 2) + ') rotate(-90)" text-anchor="middle">model states per device ('
             + u[0] + ")</text>");
    out.push('<text x="' + (left + plotW / 2) + '" y="' + (H - 6) + '" text-anchor="middle">ZeRO stage (chosen one highlighted)</text>');
    ROLES.slice().reverse().forEach(function (role, i) {
      out.push('<rect x="' + (left + plotW + 14) + '" y="' + (top + i * 18) + '" width="12" height="12" fill="' + COLORS[role] + '"/>');
      out.push('<text x="' + (left + plotW + 32) + '" y="' + (top + i * 18 + 10) + '">' + role + "</text>");
    });
    out.push("</svg>");
    return out.join("");
  }

  function init(root) {
    if (root.dataset.zeronbReady) return;
    root.dataset.zeronbReady = "1";
    var data = JSON.parse(root.querySelector("script[type='application/json']").textContent);
    var get = function (name) { return root.querySelector("[data-zeronb-calc='" + name + "']"); };
    var result = get("result"), error = get("error"), figure = get("chart");
    function update() {
      try {
        var r = calculate(data, parseNumParams(get("num_params").value), parseWorldSize(get("world_size").value),
                          parseInt(get("stage").value, 10), get("precision").value, get("optimizer").value);
        result.textContent = describe(data, r);
        result.dataset.bytes = String(r.total);
        figure.innerHTML = chart(data, r);
        error.textContent = "";
      } catch (e) {  // e.g. "7.5Q": say what is accepted, and keep the last answer and chart
        error.textContent = e.message;
      }
    }
    ["num_params", "world_size", "stage", "precision", "optimizer"].forEach(function (name) {
      get(name).addEventListener("change", update);
    });
    update();
  }

  window.zeronbCalc = {
    initAll: function () { document.querySelectorAll("[data-zeronb-calc-root]").forEach(init); },
    fmtG: fmtG, parseNumParams: parseNumParams, calculate: calculate, describe: describe
  };
  window.zeronbCalc.initAll();
})();
